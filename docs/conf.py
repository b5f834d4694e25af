"""Sphinx configuration of the sharexec documentation: ``nox -s docs`` builds it.

Pages are Markdown (myst-parser) except the API reference (``api.rst``, autosummary over
the names of ``sharexec.__all__``; ``tests/test_docs.py`` checks that the two agree).
Docstrings are numpydoc. sphinx-gallery turns ``examples/*.py`` into the gallery and runs
each of them during the build, so a broken example fails the build.

Links into the Python and NumPy docs (intersphinx) need their inventories, fetched over
the network at build time. The default build makes no network request at all, so that it
works offline and in CI; set ``SHAREXEC_DOCS_INTERSPHINX=1`` to link (a build that then
cannot fetch an inventory warns, and so fails under ``-W``). Without it, references such
as :class:`numpy.ndarray` render as plain code.
"""

from __future__ import annotations

import os

import sharexec

project = "sharexec"
author = "the sharexec developers"
copyright = "2026, the sharexec developers"
version = release = sharexec.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.intersphinx",
    "numpydoc",
    "myst_parser",
    "sphinx_gallery.gen_gallery",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
# Made by the build, ignored by git: _build/, generated/ (autosummary's stub pages),
# auto_examples/ and sg_execution_times.rst (sphinx-gallery's).
exclude_patterns = ["_build", "**/GALLERY_HEADER.rst"]
templates_path = ["_templates"]

# -- Markdown ----------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links

# -- API reference -----------------------------------------------------------------------
autosummary_generate = True
autodoc_default_options = {"members": True, "inherited-members": False}
autodoc_typehints = "none"  # numpydoc's Parameters sections give the types
numpydoc_show_class_members = False  # autosummary stubs list the members
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

# -- Intersphinx (opt-in: see the module docstring) --------------------------------------
intersphinx_mapping: dict[str, tuple[str, str | None]] = {}
if os.environ.get("SHAREXEC_DOCS_INTERSPHINX", "") not in ("", "0"):
    intersphinx_mapping = {
        "python": ("https://docs.python.org/3", None),
        "numpy": ("https://numpy.org/doc/stable", None),
    }
intersphinx_timeout = 10

# -- Gallery -----------------------------------------------------------------------------
sphinx_gallery_conf = {
    "examples_dirs": "../examples",
    "gallery_dirs": "auto_examples",
    # Run every example (each takes seconds): the gallery shows their real output.
    "filename_pattern": r".*\.py$",
    # The examples print, they draw nothing: no figure to scrape, no matplotlib to reset
    # (so that the build needs no matplotlib).
    "image_scrapers": (),
    "reset_modules": (),
    "download_all_examples": False,
    "remove_config_comments": True,
    "show_memory": False,
    "plot_gallery": "True",
}

# -- HTML --------------------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = f"sharexec {release}"
html_static_path = ["_static"]
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
    "header_links_before_dropdown": 8,
    "navbar_persistent": ["search-button"],  # an icon: all eight links fit in one row
    "secondary_sidebar_items": ["page-toc"],
}
# No left sidebar on pages that have no subpages to list in it.
html_sidebars = {
    page: []
    for page in (
        "index",
        "getting-started",
        "how-it-works",
        "performance",
        "reliability",
        "design",
        "api",
    )
}
html_show_sourcelink = False
