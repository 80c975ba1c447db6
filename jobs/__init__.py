"""trajflow.jobs"""
