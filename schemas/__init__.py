"""trajflow.schemas"""
