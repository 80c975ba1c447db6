"""trajflow.tasks"""
