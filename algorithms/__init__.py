"""trajflow.algorithms"""
