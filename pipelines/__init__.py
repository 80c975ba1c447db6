"""trajflow.pipelines"""
