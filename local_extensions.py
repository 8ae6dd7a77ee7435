"""Jinja filters that turn free text (project name, author) into inert literals.

Cookiecutter loads this file through `_extensions` in cookiecutter.json. Each filter escapes for one target
language, so a project name such as `"; $(rm -rf ~) 🚀` lands in the generated files as plain text.
"""

from jinja2.ext import Extension

_MARKDOWN_SPECIAL = "\\`*_{}[]<>()#+!|"


def toml_string(value: str) -> str:
    """A TOML basic string. Unlike JSON's \\u escapes, non-ASCII text is kept as-is (TOML forbids surrogates)."""
    escaped = []
    for char in str(value):
        if char in ('"', "\\"):
            escaped.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            escaped.append(f"\\u{ord(char):04x}")
        else:
            escaped.append(char)
    return '"' + "".join(escaped) + '"'


def python_string(value: str) -> str:
    """A Python string literal; repr() escapes quotes, backslashes and control characters."""
    return repr(str(value))


def markdown_text(value: str) -> str:
    """Text that Markdown renders literally (no code spans, links, emphasis or raw HTML)."""
    return "".join("\\" + char if char in _MARKDOWN_SPECIAL else char for char in str(value))


class TemplateFilters(Extension):
    def __init__(self, environment):
        super().__init__(environment)
        environment.filters["toml_string"] = toml_string
        environment.filters["python_string"] = python_string
        environment.filters["markdown_text"] = markdown_text
