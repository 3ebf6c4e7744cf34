"""Recording experiments: MLflow runs and the session's report."""
