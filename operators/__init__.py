"""trajflow.operators"""
