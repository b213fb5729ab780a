"""Sphinx configuration for the asyncpipe documentation."""

project = "asyncpipe"
author = "the asyncpipe authors"
copyright = "2026, the asyncpipe authors"
release = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
html_theme = "alabaster"
nitpicky = False
suppress_warnings = ["myst.header"]
