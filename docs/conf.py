"""Sphinx configuration of gradus's site. Build with `python docs/build.py`, which first writes the
sources (preprocessed notebooks, these pages) to docs/_build/src."""
import importlib.util
import re

project = 'gradus'
author = 'gradus developers'
copyright = '2026, gradus developers'
root_doc = 'index'  # nbs/index.ipynb, with the contents appended by build.py

extensions = ['myst_nb']
# MathJax bundled with the site (no CDN): the `sphinx-mathjax-offline` package copies MathJax 3
# into _static/mathjax and points Sphinx at it. Its import name has hyphens.
if importlib.util.find_spec('sphinx-mathjax-offline') is None:
    raise RuntimeError("sphinx-mathjax-offline is not installed: pip install -e '.[docs]'")
extensions.append('sphinx-mathjax-offline')

myst_enable_extensions = ['dollarmath', 'amsmath', 'colon_fence']
myst_heading_anchors = 3
nb_execution_mode = 'off'  # the stored outputs are the documentation: nothing is executed
nb_merge_streams = True    # consecutive prints of one cell read as one block
nb_output_stderr = 'show'
exclude_patterns = ['_generated/module_table.md']  # included by module-map.md
toc_object_entries = False  # page outlines list sections; API entries are in the index and search

html_theme = 'sphinx_book_theme'
html_title = 'gradus'
html_copy_source = False
html_show_sourcelink = False
html_theme_options = {
    'show_toc_level': 2,
    'home_page_in_toc': True,
    'use_download_button': False,
    'use_fullscreen_button': False,
}
pygments_style = 'default'


def _nb_role(name, rawtext, text, lineno, inliner, options=None, content=None):
    """`{nb}`tensor`` links to the notebook of a module whatever its number and wing, shown by its
    name (`02_tensor`); `{nb}`text <tensor>`` sets the text; a companion is named by its whole
    stem after the number (`{nb}`graph_codegen`` for `05a_graph_codegen`). An unknown module, or
    one that names two notebooks, is an error."""
    from docutils import nodes
    from sphinx import addnodes
    env = inliner.document.settings.env
    m = re.match(r'^(.*?)\s*<(\w+)>$', text)
    title, stem = (m.group(1), m.group(2)) if m else (None, text.strip())
    found = sorted(d for d in env.found_docs
                   if re.fullmatch(rf'(\d+[a-z]?_)?{re.escape(stem)}', d))
    if len(found) > 1:   # a module's lesson before an exercises page of the same name (models)
        found = [d for d in found if d[0].isdigit()] or found
    if len(found) != 1:
        msg = inliner.reporter.error(
            f'{{nb}} role: no single notebook for module {stem!r} (found {found})', line=lineno)
        return [inliner.problematic(rawtext, rawtext, msg)], [msg]
    ref = addnodes.pending_xref(rawtext, refdomain='std', reftype='doc', reftarget='/' + found[0],
                                refexplicit=True, refwarn=True, refdoc=env.docname)
    ref += nodes.inline(rawtext, title or found[0])
    return [ref], []


def setup(app):
    app.add_role('nb', _nb_role)
