"""The training package behind train.py: options, torchrun environment, data, model, checkpoints, reporting."""

PROJECT_NAME = {{ cookiecutter.project_name | python_string }}  # noqa: E501 - the name as given when generated
