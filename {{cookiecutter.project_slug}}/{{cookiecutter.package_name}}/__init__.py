"""The training package behind train.py: options, torchrun environment, data, model, checkpoints, reporting."""

{# Built-in filters only: cruft renders two template versions in one process. Escaping backslashes and double
    quotes is enough for a Python string: the pre-generation hook refuses control characters, and non-ASCII
    text is valid UTF-8 source. -#}
PROJECT_NAME = "{{ cookiecutter.project_name | replace('\\', '\\\\') | replace('"', '\\"') }}"  # noqa: E501 - the name as given when generated
