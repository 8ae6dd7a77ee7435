"""{{ cookiecutter.project_name | python_string }}: distributed training launched by torchrun."""

PROJECT_NAME = {{ cookiecutter.project_name | python_string }}
