"""The documentation site (docs/build.py) as a reader sees it: built with warnings as errors from
the notebooks' stored outputs, then opened in headless Chromium (the Debian `chromium` package,
driven by its command line).

One Chromium run loads a small checking page from the same local server as the site; it opens
every page in an iframe, lets the page's JavaScript run (MathJax, search) and writes what it found
as JSON into its own DOM, which `--dump-dom` hands back. The expected counts (pages, figures,
formulas) are read from the notebooks here, not from the build. The preprocessing rules (nbdev
directives, API entries, links) are checked on a small notebook the test writes; the hand-written
pages' example outputs are checked by running the examples."""
import html, html.parser, http.server, importlib.util, json, re, shutil, subprocess, sys
import atexit, tempfile, threading
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit, unquote
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS, NBS = ROOT / 'docs', ROOT / 'nbs'
CHROMIUM = shutil.which('chromium') or shutil.which('chromium-browser')
MISSING = [m for m in ('sphinx', 'myst_nb', 'sphinx_book_theme', 'sphinx-mathjax-offline')
           if importlib.util.find_spec(m) is None]
needs_docs = pytest.mark.skipif(
    bool(MISSING),
    reason=f"docs extra not installed ({', '.join(MISSING)}): pip install -e '.[docs]'")
needs_browser = pytest.mark.skipif(
    CHROMIUM is None, reason='no chromium on PATH: apt-get install -y chromium')
# the package's own notebooks (nbs/) and the wings' (nbs/<wing>/); a page is named by the stem
NOTEBOOKS = sorted([*NBS.glob('*.ipynb'), *NBS.glob('*/*.ipynb')], key=lambda p: p.stem)


def _load_build():
    spec = importlib.util.spec_from_file_location('gradus_docs_build', DOCS / 'build.py')
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cells(path):
    return json.loads(path.read_text(encoding='utf-8'))['cells']


def _directive(cell, pattern):
    return re.search(rf'^\s*#\|\s*{pattern}', ''.join(cell['source']), re.M) is not None


def expected_figures(path):
    "Stored images a reader should see: image outputs of cells not hidden, outputs not dropped."
    n = 0
    for c in _cells(path):
        if c['cell_type'] != 'code' or _directive(c, r'(hide|default_exp)\b'): continue
        if _directive(c, r'output:\s*false'): continue
        n += sum(any(k.startswith('image/') for k in o.get('data', {}))
                 for o in c.get('outputs', []))
    return n


def has_formula(path):
    "A Markdown cell with TeX maths: `$...$` or `$$...$$` outside code."
    for c in _cells(path):
        if c['cell_type'] != 'markdown': continue
        text = re.sub(r'```.*?```|`[^`]*`', '', ''.join(c['source']), flags=re.S)
        if re.search(r'\$\$.+?\$\$|\$[^$\s][^$]*\$', text, re.S): return True
    return False


def _defining_notebook(name):
    for nb in NOTEBOOKS:
        for c in _cells(nb):
            src = ''.join(c['source'])
            if c['cell_type'] == 'code' and re.search(rf'^def {name}\(', src, re.M):
                return nb.stem
    return None

# ---------------------------------------------------------------------------- the built site
# The build (~25 s of CPU) and the browser's visit of every page (~20 s, most of it waiting) run
# once a session, in a thread that tests/conftest.py starts as soon as the session has collected a
# test that reads the site: they overlap the tests that run before this module.


CHECK_PAGE = """<!doctype html><html><head><meta charset="utf-8"></head><body>
<pre id="out">pending</pre><script>
const PAGES = %s;
const sleep = ms => new Promise(r => setTimeout(r, ms));
async function visit(url) {
  const f = document.createElement('iframe');
  f.style.width = '1200px'; f.style.height = '900px';
  document.body.appendChild(f);
  await new Promise(res => { f.onload = res; f.src = url; });
  const w = f.contentWindow, d = f.contentDocument, r = {url: url, title: d.title};
  r.images = [];
  for (const img of d.querySelectorAll('img')) {
    img.loading = 'eager';
    try { await img.decode(); } catch (e) {}
    r.images.push({src: img.getAttribute('src'), loaded: img.complete && img.naturalWidth > 0,
                   output: !!img.closest('.cell_output, .output')});
  }
  const maths = [...d.querySelectorAll('.math')];
  if (maths.length) {
    const ready = () => w.MathJax && w.MathJax.startup && w.MathJax.startup.promise;
    for (let i = 0; i < 400 && !ready(); i++) await sleep(25);
    if (ready()) await w.MathJax.startup.promise;
  }
  r.math = maths.length;
  r.typeset = maths.filter(e => e.querySelector('mjx-container')).length;
  r.mathErrors = d.querySelectorAll('mjx-merror').length;
  if (url.includes('search.html')) {
    for (let i = 0; i < 400 && !d.querySelector('#search-results li a'); i++) await sleep(25);
    r.results = [...d.querySelectorAll('#search-results li a')].map(a => a.getAttribute('href'));
  }
  r.text = (d.querySelector('main') || d.body).innerText.length;
  f.remove();
  return r;
}
(async () => {
  const out = [];
  for (const p of PAGES) {
    try { out.push(await visit(p)); } catch (e) { out.push({url: p, error: String(e)}); }
  }
  document.getElementById('out').textContent = JSON.stringify(out);
})();
</script></body></html>"""


class _Handler(http.server.SimpleHTTPRequestHandler):
    "The site's files, plus the checking page at /__check__.html."
    check_page = b''

    def do_GET(self):
        if not self.path.startswith('/__check__.html'): return super().do_GET()
        self.send_response(200)
        self.send_header('Content-Type', 'text/html; charset=utf-8')
        self.send_header('Content-Length', str(len(self.check_page)))
        self.end_headers()
        self.wfile.write(self.check_page)

    def log_message(self, *args): pass


def _chromium_cmd(args, tmp):
    return [CHROMIUM, '--headless', '--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage',
            '--no-first-run', '--hide-scrollbars', f'--user-data-dir={tmp / "profile"}', *args]


def chromium(args, tmp, timeout=180):
    return subprocess.run(_chromium_cmd(args, tmp), capture_output=True, text=True,
                          timeout=timeout)


class _Background:
    """The site built into a temporary folder (`docs/build.py`, warnings as errors), served on a
    loopback port, so that pages fetch as on a web server, not from file://, and, with `browse`,
    what the browser found on every page and on a search for `logsumexp` (`CHECK_PAGE`)."""

    def __init__(self, browse):
        self.tmp = tempfile.TemporaryDirectory(prefix='gradus-docs-')
        self.root, self.browse = Path(self.tmp.name), browse
        self.build = self.httpd = self.checked = self.error = None
        self.built, self.procs, self.closed = threading.Event(), [], False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        atexit.register(self.close)  # a session that ends before the module (-x) stops them too

    def _call(self, cmd, timeout):
        "`subprocess.run(cmd)` that `close` can stop: killed past `timeout`, output kept."
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        self.procs.append(p)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        return subprocess.CompletedProcess(cmd, p.returncode, out, err)

    def _run(self):
        try:
            self.build = self._call([sys.executable, str(DOCS / 'build.py'), '--out',
                                     str(self.root / 'site')], timeout=300)
            self.built.set()
            if self.build.returncode or not self.browse: return
            self.httpd = http.server.ThreadingHTTPServer(
                ('127.0.0.1', 0), partial(_Handler, directory=str(self.html_dir)))
            threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
            self.checked = self._check()
        except BaseException as e:  # raised again in the fixture that waits for it
            self.error = e
        finally:
            self.built.set()

    def _check(self):
        pages = sorted(p.name for p in self.html_dir.glob('*.html') if p.name != 'search.html')
        urls = [f'/{p}' for p in pages] + ['/search.html?q=logsumexp']
        _Handler.check_page = (CHECK_PAGE % json.dumps(urls)).encode()
        # --dump-dom returns when the virtual-time budget is spent; on a busy machine the checks
        # can still be running then (the page says "pending"), so a larger budget is tried
        for k, budget in enumerate((120_000, 400_000, 1_200_000)):
            r = self._call(_chromium_cmd([f'--virtual-time-budget={budget}', '--dump-dom',
                                          f'{self.url}/__check__.html'], self.root / f'chr{k}'),
                           timeout=400)
            m = re.search(r'<pre id="out">(.*?)</pre>', r.stdout, re.S)
            if m and m.group(1) != 'pending': break
        return r, m

    html_dir = property(lambda self: self.root / "site" / "html")
    url = property(lambda self: f'http://127.0.0.1:{self.httpd.server_address[1]}')

    def wait(self, browsed=False):
        (self.thread.join if browsed else self.built.wait)()
        if self.error is not None: raise self.error

    def close(self):
        if self.closed: return
        self.closed = True
        for p in self.procs:
            if p.poll() is None: p.kill()
        self.thread.join(timeout=30)
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
        self.tmp.cleanup()


_BACKGROUND = []


def start_site(browse=True):
    "The session's `_Background` (started at the first call; none without the docs extra)."
    if MISSING: return None
    if not _BACKGROUND: _BACKGROUND.append(_Background(browse and CHROMIUM is not None))
    return _BACKGROUND[0]


@pytest.fixture(scope='module')
def background():
    run = start_site()
    yield run
    if run is not None: run.close()
    _BACKGROUND.clear()


@pytest.fixture(scope='module')
def site(background):
    background.wait()
    r = background.build
    assert r.returncode == 0, \
        f'docs build failed (warnings are errors):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}'
    return background.html_dir


@pytest.fixture(scope='module')
def server(site, background):
    "The site on a loopback port (started once the build is done)."
    background.wait(browsed=True)
    return background.url


@pytest.fixture(scope='module')
def seen(site, background):
    "What the browser found on every page of the site and on a search for `logsumexp`."
    background.wait(browsed=True)
    r, m = background.checked
    assert m and m.group(1) != 'pending', \
        f'the checking page did not finish:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}'
    reports = json.loads(html.unescape(m.group(1)))
    assert not [rep for rep in reports if 'error' in rep], reports
    return {rep['url'].lstrip('/'): rep for rep in reports}


@needs_docs
@needs_browser
def test_every_notebook_has_a_page(seen):
    assert NOTEBOOKS
    quotes = {ord('’'): "'", ord('‘'): "'", ord('“'): '"', ord('”'): '"'}  # Sphinx's smartquotes
    def plain(s): return re.sub(r'[`*_\s]', '', s).translate(quotes)  # emphasis, code marks hide
    for nb in NOTEBOOKS:
        page = f'{nb.stem}.html'
        assert page in seen, f'{nb.name} has no page'
        title = next(m.group(1) for c in _cells(nb) if c['cell_type'] == 'markdown'
                     for m in [re.search(r'^#\s+(.+)$', ''.join(c['source']), re.M)] if m)
        assert plain(seen[page]['title']).startswith(plain(title)), (page, seen[page]['title'])
        assert seen[page]['text'] > 200, f'{page} shows almost no text'


class _Sidebar(html.parser.HTMLParser):
    "The sidebar of a page: [(caption, [page linked])] in order."
    def __init__(self):
        super().__init__()
        self.sections, self.in_caption, self.in_nav = [], False, 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == 'nav' and 'bd-docs-nav' in (a.get('class') or ''): self.in_nav = 1
        elif tag == 'nav' and self.in_nav: self.in_nav += 1
        if not self.in_nav: return
        if tag == 'span' and 'caption-text' in (a.get('class') or ''): self.in_caption = True
        if tag == 'a' and self.sections and a.get('href', '').endswith('.html'):
            self.sections[-1][1].append(a['href'].rsplit('/', 1)[-1][:-5])

    def handle_endtag(self, tag):
        if tag == 'nav' and self.in_nav: self.in_nav -= 1
        if tag == 'span': self.in_caption = False

    def handle_data(self, data):
        if self.in_caption and data.strip(): self.sections.append((data.strip(), []))


@needs_docs
def test_sidebar_follows_the_wings(site):
    """The sidebar has a section per wing in reading order, each listing its notebooks by number,
    a companion (`05a_...`) right after its lesson; every notebook is in exactly one section."""
    bar = _Sidebar()
    bar.feed((site / 'index.html').read_text(encoding='utf-8'))
    caps = [c for c, _ in bar.sections]
    b = _load_build()
    want = list(dict.fromkeys(c for c, *_ in b.SECTIONS))
    assert [c for c in caps if c in want] == [c for c in want if c in caps], caps
    assert caps[0] == 'Guides' and want[0] in caps and 'Errors' in caps, caps
    listed = [p for c, pages in bar.sections if c != 'Guides' for p in pages]
    stems = sorted(p.stem for p in NOTEBOOKS if p.stem != 'index')
    assert sorted(listed) == stems, (sorted(set(stems) - set(listed)), listed)
    for cap, pages in bar.sections:
        nums = [re.match(r'(\d+)([a-z]?)_', p) for p in pages]
        keys = [(int(m.group(1)), m.group(2)) for m in nums if m]
        assert keys == sorted(keys), (cap, pages)
    wing = {p.stem: p.parent.name for p in NOTEBOOKS}
    for cap, pages in bar.sections[1:]:  # one wing a section; the command line: jobs and nbs/
        assert len({wing[p] for p in pages}) <= (2 if cap == 'The command line' else 1), pages
    part1 = next(pages for c, pages in bar.sections if c == want[0])
    assert part1[0] == '00_dtype' and all(wing[p] == 'core' for p in part1), part1
    text = (site / 'index.html').read_text(encoding='utf-8')
    for p in NOTEBOOKS:
        if re.match(r'\d+[a-z]_', p.stem):
            assert re.search(rf'href="{p.stem}.html">[^<]*↳', text), f'{p.stem}: not marked'


@needs_docs
@needs_browser
def test_formulas_are_typeset(seen):
    for nb in NOTEBOOKS:
        if has_formula(nb):
            assert seen[f'{nb.stem}.html']['math'] > 0, f'{nb.stem} has formulas; its page none'
    with_maths = {p: r for p, r in seen.items() if r['math']}
    assert with_maths, 'no page of the site has maths'
    for page, r in with_maths.items():
        assert r['typeset'] == r['math'] and r['mathErrors'] == 0, \
            (page, r['math'], r['typeset'], r['mathErrors'])


@needs_docs
@needs_browser
def test_every_stored_figure_is_an_image_that_loaded(seen):
    total = 0
    for nb in NOTEBOOKS:
        imgs = [i for i in seen[f'{nb.stem}.html']['images'] if i['output']]
        assert len(imgs) == expected_figures(nb), (nb.name, len(imgs), expected_figures(nb))
        assert all(i['loaded'] for i in imgs), \
            (nb.name, [i['src'] for i in imgs if not i['loaded']])
        total += len(imgs)
    assert total > 0, 'no notebook stores a figure: the check would prove nothing'
    for page, r in seen.items():  # the hand-written pages' pictures (the module graph) load too
        assert all(i['loaded'] for i in r['images']), \
            (page, [i['src'] for i in r['images'] if not i['loaded']])


@needs_docs
@needs_browser
def test_search_finds_an_api_name(seen):
    home = _defining_notebook('logsumexp')
    assert home, 'no notebook defines logsumexp'
    results = seen['search.html?q=logsumexp']['results']
    assert any(h.split('#')[0].endswith(f'{home}.html')
               and h.endswith('#gradus.core.ops.logsumexp') for h in results), results


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids, self.refs = set(), []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if 'id' in a: self.ids.add(a['id'])
        if tag == 'a' and 'name' in a: self.ids.add(a['name'])
        for key in ('href', 'src'):
            if a.get(key) and tag in ('a', 'img', 'link', 'script'): self.refs.append(a[key])


@needs_docs
def test_no_broken_internal_links(site):
    parsed = {}
    def parse(p):
        if p not in parsed:
            parsed[p] = _Links()
            parsed[p].feed(p.read_text(encoding='utf-8'))
        return parsed[p]
    broken, checked = [], 0
    for page in sorted(site.glob('*.html')):  # (_static/ holds the theme's template macros)
        for ref in parse(page).refs:
            parts = urlsplit(ref)
            if parts.scheme or ref.startswith('//'): continue
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            checked += 1
            if not target.is_file() or site.resolve() not in target.parents:
                broken.append(f'{page.name}: {ref}')
            elif parts.fragment and target.suffix == '.html' \
                    and unquote(parts.fragment) not in parse(target).ids:
                broken.append(f'{page.name}: {ref} (no such anchor)')
    assert checked > 100, checked
    assert not broken, broken[:20]


@needs_docs
def test_nothing_is_fetched_from_another_host(site):
    "Offline: no page loads a script, style sheet or image from elsewhere (MathJax is bundled)."
    remote = []
    for page in site.glob('*.html'):
        tags = re.findall(r'<(?:script|link|img)[^>]+(?:src|href)="(https?:[^"]+)"',
                          page.read_text(encoding='utf-8'))
        remote += [f'{page.name}: {t}' for t in tags]
    assert not remote, remote[:10]
    assert (site / '_static' / 'mathjax' / 'tex-chtml.js').is_file()


@needs_docs
@needs_browser
def test_screenshot_of_a_lesson(server, tmp_path):
    home = _defining_notebook('logsumexp')
    shot = tmp_path / f'{home}.png'
    r = chromium(['--window-size=1280,900', '--virtual-time-budget=10000', f'--screenshot={shot}',
                  f'{server}/{home}.html'], tmp_path)
    assert shot.is_file(), r.stderr[-2000:]
    import matplotlib.image as mpimg
    pixels = mpimg.imread(shot)
    assert pixels.shape[:2] == (900, 1280) and pixels.std() > 0.05, 'the screenshot is blank'
    print(f'screenshot: {shot}')

# ---------------------------------------------------------------------- the preprocessing rules


def _nb(cells):
    def cell(kind, src, outputs=()):
        c = {'cell_type': kind, 'metadata': {}, 'source': src}
        if kind == 'code': c.update(outputs=list(outputs), execution_count=None)
        return c
    return {'nbformat': 4, 'nbformat_minor': 5, 'metadata': {}, 'cells': [cell(*c) for c in cells]}


def _out(text): return {'output_type': 'stream', 'name': 'stdout', 'text': text}


TWICE = 'def twice(x: float) -> float:\n    "Return `2 * x`; see `half`."\n    return 2 * x'
HALF = 'class Half:\n    "Halves."\n    def of(self, x):\n        "`x / 2`."\n        return x / 2'


def test_directives_are_honoured(tmp_path):
    b = _load_build()
    path = tmp_path / '07_demo.ipynb'
    path.write_text(json.dumps(_nb([
        ('markdown', '# demo\n\nSee `twice` and `D.twice()`, not `nothing`, and ``twice``.'),
        ('markdown', '#| export\nA summary for the package docstring.'),
        ('code', '#| default_exp core.demo'),
        ('code', '#| hide\nsecret = 1', [_out('hidden output\n')]),
        ('code', '#| export\n#| hide\ndef hidden_impl():\n    "Documented, source hidden."'),
        ('code', f'#| export\n{TWICE}\n_private = 0\nLIMIT = 3'),
        ('code', '#| echo: false\nprint("only the output")', [_out('only the output\n')]),
        ('code', '#| output: false\nprint("no output")', [_out('dropped output\n')]),
        ('code', '# NBVAL_CHECK_OUTPUT\nx = 1\ny = 2  #| hide_line\nprint(x)', [_out('1\n')]),
        ('code', f'#| export\n{HALF}'),
        ('code', 'from gradus.core import demo as D'),
    ])))
    nb = b.Notebook(path, 'core')
    full, short = b.build_index([nb])
    m = 'gradus.core.demo'
    assert set(full) == {m, f'{m}.hidden_impl', f'{m}.twice', f'{m}.LIMIT', f'{m}.Half',
                         f'{m}.Half.of'}
    out = b.process(nb, b.Linker(full, short, {'07_demo': 'core'}, {}, {m}))
    text = json.dumps(out)
    assert 'secret' not in text and 'hidden output' not in text and 'default_exp' not in text
    assert 'def hidden_impl' not in text and 'dropped output' not in text and 'NBVAL' not in text
    code = [c for c in out['cells'] if c['cell_type'] == 'code']
    assert [c['source'] for c in code] == [
        f'{TWICE}\n_private = 0\nLIMIT = 3', 'print("only the output")', 'print("no output")',
        'x = 1\nprint(x)', HALF, 'from gradus.core import demo as D']
    assert code[1]['metadata']['tags'] == ['remove-input'] and code[1]['outputs']
    assert code[2]['outputs'] == [] and code[3]['outputs'][0]['text'] == '1\n'
    md = [c['source'] for c in out['cells'] if c['cell_type'] == 'markdown']
    assert md[0] == ('# demo\n\nSee {py:obj}`twice <gradus.core.demo.twice>` and '
                     '{py:obj}`D.twice() <gradus.core.demo.twice>`, not `nothing`, and ``twice``.')
    assert md[1] == f'```{{py:module}} {m}\n:no-contents-entry:\n```'  # the module's target
    assert md[2] == 'A summary for the package docstring.'  # its `#| export` is nbdev's
    assert '{py:function} hidden_impl()' in md[3] and 'Documented, source hidden.' in md[3]
    assert ('{py:function} twice(x: float) -> float\n:module: gradus.core.demo\n\n'
            'Return `2 * x`; see `half`.') in md[4]
    assert '{py:data} LIMIT' in md[4] and '_private' not in md[4]
    assert '{py:class} Half' in md[5] and '{py:method} of(x)' in md[5]


def _write(root, rel, cells):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_nb(cells)))
    return path


def _wings(tmp_path):
    "A small nbs/ in wings: two lessons of core with a companion, a job, the command line."
    b = _load_build()
    nbs = tmp_path / 'nbs'
    _write(nbs, 'index.ipynb', [('markdown', '# demo'), ('code', '#| default_exp __init__'),
                                ('code', '#| export\nfrom gradus.core.tensor import add')])
    _write(nbs, 'errors.ipynb', [('markdown', '# errors'), ('code', '#| default_exp errors')])
    _write(nbs, '30_main.ipynb', [('markdown', '# main'), ('code', '#| default_exp __main__')])
    _write(nbs, 'core/02_tensor.ipynb', [
        ('markdown', '# tensor'), ('code', '#| default_exp core.tensor'),
        ('code', '#| export\ndef add(a, b): return a + b\ndef sum(x): return x\n'
                 'class Tracer:\n    def mean(self):\n        "The mean."')])
    _write(nbs, 'core/05_graph.ipynb', [
        ('markdown', '# graph'), ('code', '#| default_exp core.graph'),
        ('code', '#| export\ndef trace(f): return f')])
    _write(nbs, 'core/05a_codegen.ipynb', [
        ('markdown', '# `codegen` — source'), ('code', '#| default_exp core.codegen')])
    _write(nbs, 'learn/11_nn.ipynb', [
        ('markdown', '# nn'), ('code', '#| default_exp learn.nn'),
        ('code', '#| export\ndef linear(p, x): return x\ndef sum(x): return x'),
        ('code', 'from gradus.core import tensor as T\nimport gradus as gd')])
    _write(nbs, 'jobs/29_cli.ipynb', [('markdown', '# cli'), ('code', '#| default_exp jobs.cli')])
    _write(nbs, 'jobs/16_job.ipynb', [('markdown', '# job'), ('code', '#| default_exp jobs.job')])
    return b, nbs


def test_notebooks_are_found_in_their_wings(tmp_path):
    b, nbs = _wings(tmp_path)
    found = {nb.name: (nb.wing, nb.number, nb.letter) for nb in b.find_notebooks(nbs)}
    assert found == {'index': ('', None, ''), 'errors': ('', None, ''), '30_main': ('', 30, ''),
                     '02_tensor': ('core', 2, ''), '05_graph': ('core', 5, ''),
                     '05a_codegen': ('core', 5, 'a'), '11_nn': ('learn', 11, ''),
                     '16_job': ('jobs', 16, ''), '29_cli': ('jobs', 29, '')}
    _write(nbs, 'learn/05_graph.ipynb', [('markdown', '# again')])
    with pytest.raises(SystemExit, match="two notebooks named '05_graph'"):
        b.find_notebooks(nbs)


def test_sections_follow_the_reading_order(tmp_path):
    b, nbs = _wings(tmp_path)
    notebooks = b.find_notebooks(nbs)
    got = [(caption, [nb.name for nb in group]) for caption, group in b.sections(notebooks)]
    assert got == [
        ('Part I, training: the autodiff core', ['02_tensor', '05_graph', '05a_codegen']),
        ('Part I, training: learning', ['11_nn']),
        ('Part I, training: the main job', ['16_job']),
        ('The command line', ['29_cli', '30_main']),
        ('Errors', ['errors'])]
    toc = b.toctree_cell(notebooks)
    assert '05_graph\n↳ companion: codegen — source <05a_codegen>\n' in toc
    assert toc.index(':caption: Part I, training: learning') < toc.index(':caption: Errors')
    by = {nb.name: nb for nb in notebooks}
    assert b.lesson_of(by['05a_codegen'], notebooks) is by['05_graph']
    [(where, note)] = b.companion_notes(by['05_graph'], notebooks)
    assert where == 'end' and '{doc}`05a_codegen` holds' in note
    [(where, note)] = b.companion_notes(by['05a_codegen'], notebooks)
    assert where == 'top' and 'companion of {doc}`05_graph`' in note
    assert b.companion_notes(by['11_nn'], notebooks) == []
    _write(nbs, 'misc/40_odd.ipynb', [('markdown', '# odd')])  # a wing with no place: refused
    with pytest.raises(SystemExit, match='40_odd.ipynb: not in exactly one section'):
        b.sections(b.find_notebooks(nbs))


def test_dotted_names_and_notebook_paths_are_linked(tmp_path):
    "API names resolve through wings and aliases; a notebook path links only where it is right."
    b, nbs = _wings(tmp_path)
    notebooks = b.find_notebooks(nbs)
    full, short = b.build_index(notebooks)
    reexports = next(nb for nb in notebooks if nb.name == 'index').reexports()
    linker = b.Linker(full, short, {nb.name: nb.wing for nb in notebooks}, reexports,
                      {b._modname(nb.module) for nb in notebooks if nb.module})
    nn = next(nb for nb in notebooks if nb.name == '11_nn')
    ok = {'T.sum': 'gradus.core.tensor.sum', 'tensor.sum': 'gradus.core.tensor.sum',
          'core.tensor.sum': 'gradus.core.tensor.sum', 'gd.add': 'gradus.core.tensor.add',
          'gradus.core.tensor.add': 'gradus.core.tensor.add', 'nn.linear': 'gradus.learn.nn.linear',
          'learn.nn': 'gradus.learn.nn', 'Tracer.mean': 'gradus.core.tensor.Tracer.mean',
          'sum': 'gradus.learn.nn.sum',  # a short name of two modules: the notebook's own
          'trace': 'gradus.core.graph.trace', 'gd.tensor.add': None, 'x.mean': None,
          'graph.sum': None, 'np.sum': None}
    assert {t: linker.resolve(t, nn) for t in ok} == ok
    graph = next(nb for nb in notebooks if nb.name == '05_graph')
    assert linker.resolve('sum', graph) is None  # two candidates, neither its own
    line = ('`nbs/core/05_graph.ipynb`, `nbs/learn/05_graph.ipynb`, `nbs/05_graph.ipynb`, '
            '`nbs/30_main.ipynb`, `05a_codegen`, `05_graph.ipynb`, `05c_none`')
    assert linker.link(line, nn) == (
        '{doc}`nbs/core/05_graph.ipynb <05_graph>`, `nbs/learn/05_graph.ipynb`, '
        '`nbs/05_graph.ipynb`, {doc}`nbs/30_main.ipynb <30_main>`, '
        '{doc}`05a_codegen <05a_codegen>`, {doc}`05_graph.ipynb <05_graph>`, `05c_none`')


def test_repository_files_are_copied_from_a_wing(tmp_path):
    "A link relative to a wing's notebook (`../../README.md`) reaches the file, copied beside."
    b = _load_build()
    wanted = set()
    md = b._repo_files('![a](../../README.md) and [b](../errors.ipynb)', tmp_path, wanted,
                       NBS / 'core')
    assert md == '![a](_repo/README.md) and [b](_repo/nbs/errors.ipynb)'
    assert (tmp_path / '_repo' / 'README.md').read_bytes() == (ROOT / 'README.md').read_bytes()
    assert wanted == {'_repo/README.md', '_repo/nbs/errors.ipynb'}
    with pytest.raises(SystemExit, match='not a file of the repository'):
        b._repo_files('![c](../../../outside.png)', tmp_path, wanted, NBS / 'core')


def test_heading_gaps_are_closed():
    b = _load_build()
    level = [0]
    assert b.close_heading_gaps('# a\n### b\n```\n### not a heading\n```', level) == \
        '# a\n## b\n```\n### not a heading\n```'
    assert b.close_heading_gaps('#### c', level) == '### c'

# ---------------------------------------------------------------- the hand-written pages' outputs


@pytest.mark.parametrize('script', sorted((DOCS / 'examples').glob('*.py')), ids=lambda p: p.name)
def test_example_output_is_real(script):
    "Each program a hand-written page shows prints exactly the output the page shows beside it."
    r = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == script.with_suffix('.out').read_text(encoding='utf-8')
