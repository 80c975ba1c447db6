"""trajflow.engines"""
