"""Tokenizer: char tokenizer, SmolLM2's byte-level BPE against the Hugging Face `tokenizers`
package, and chat templates on a budget."""
import contextlib, os, signal, sys, tracemalloc, unicodedata
from pathlib import Path
import numpy as np, pytest
from gradus.formats import gguf as G, tokenizer
from gradus.formats.tokenizer import CharTokenizer
from gradus.errors import TokenizerError

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get('GRADUS_DATA', ROOT.parent / 'shared' / 'data'))

@pytest.fixture(scope='module')
def shakespeare():
    p = DATA / 'tinyshakespeare.txt'
    if not p.exists(): pytest.skip(f"Tiny Shakespeare not found at {p} (set GRADUS_DATA)")
    return p.read_text(encoding='utf-8')

@pytest.fixture(scope='module')
def tok():
    try: path = G.smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 GGUF absent (install the models extra): {e}")
    return tokenizer.from_gguf(G.open_gguf(path))

@pytest.fixture(scope='module')
def hf(tok):
    from tokenizers import Tokenizer, models, pre_tokenizers, AddedToken
    md = G.open_gguf(G.smollm2_path()).metadata
    merges = [tuple(m.split(' ')) for m in md['tokenizer.ggml.merges']]
    t = Tokenizer(models.BPE({s: i for i, s in enumerate(tok.tokens)}, merges))
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                        use_regex=True)])
    t.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in tok._special])
    return t

FRAGMENTS = ["café", "naïve", "Ångström", "façade", "über", "jalapeño", "日本語のテキスト",
             "東京", "中文分词", "한국어", "Привет, мир", "Ελληνικά", "مرحبا", "שלום", "हिन्दी",
             "🙂", "👩\u200d👩\u200d👧", "🇫🇷", "🎉🎉", "3.14159", "1,000,000", "2024-01-31",
             "42", "007", "½", "x²", "Ⅻ", "٣٤", "don't", "I'll", "WE'RE", "'s", "they've",
             "def f(x):\n    return x**2", "    ", "\t\t", "\n\n", "\r\n", " \xa0 ", "\u3000",
             "...", "?!", "—", "«quote»", "<b>bold</b>", "a_b-c", "@user", "#tag", "$9.99",
             "100%", "e=mc^2", "C++", "NaN", "ÀÉÎÕÜ", "ß", "ﬁ", "\u200b", "tab\there",
             "  leading", "trailing  "]

def varied_lines(n, seed=0):
    rng = np.random.default_rng(seed)
    seps = [' ', '', '  ', '\n', '\t', ', ', ' - ']
    return [''.join(FRAGMENTS[rng.integers(len(FRAGMENTS))] + seps[rng.integers(len(seps))]
                    for _ in range(rng.integers(1, 12))) for _ in range(n)]

# ---------- char tokenizer ----------
def test_char_tokenizer_roundtrip_shakespeare(shakespeare):
    ct = CharTokenizer.from_text(shakespeare)
    assert ct.vocab_size == len(set(shakespeare)) == 65
    ids = ct.encode(shakespeare)
    assert ct.decode(ids) == shakespeare and max(ids) < 65 and min(ids) == 0

def test_char_tokenizer_errors():
    ct = CharTokenizer.from_text('abc')
    assert ct.encode('cab') == [2, 0, 1]
    with pytest.raises(TokenizerError, match=r"'z'.*position 2"): ct.encode('abz')
    with pytest.raises(TokenizerError, match='id 3'): ct.decode([0, 3])
    with pytest.raises(TokenizerError, match='id -1'): ct.decode([-1])

# ---------- BPE against the tokenizers package ----------
def test_special_ids(tok):
    assert (tok.bos_id, tok.eos_id) == (1, 2) and tok.eog_ids == {0, 2}
    assert tok.tokens[1] == '<|im_start|>' and tok.vocab_size == 49152

def test_ids_equal_tokenizers_package(tok, hf, shakespeare):
    lines = [l for l in shakespeare.splitlines() if l.strip()][:1500] + varied_lines(1500)
    assert len(lines) >= 2000
    bad = [l for l in lines if tok.encode(l) != hf.encode(l, add_special_tokens=False).ids]
    assert not bad, f"{len(bad)} lines differ, e.g. {bad[:3]!r}"
    block = '\n'.join(lines[1400:1700])
    assert tok.encode(block) == hf.encode(block, add_special_tokens=False).ids

def test_parse_special(tok, hf):
    text = "<|im_start|>user\nHello 2 you<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, parse_special=True)
    assert ids == hf.encode(text, add_special_tokens=False).ids and ids[0] == 1 and 2 in ids
    plain = tok.encode(text)
    assert 1 not in plain and 2 not in plain and tok.decode(plain) == text
    assert tok.encode('hi', add_bos=True)[0] == 1

def test_roundtrip_identity(tok, shakespeare):
    assert tok.decode(tok.encode(shakespeare)) == shakespeare
    for line in varied_lines(300, seed=1) + ["   \n\n\t  x", "1234567890" * 5, "🙂" * 7, ""]:
        assert tok.decode(tok.encode(line)) == line

def test_streaming_decode_holds_back_partial_utf8(tok):
    for line in varied_lines(200, seed=2):
        ids = tok.encode(line)
        s = tok.stream()
        parts = [s.push(i) for i in ids] + [s.flush()]
        assert ''.join(parts) == line and not any('\ufffd' in p for p in parts)
    emoji = tok.encode('🙂')
    assert len(emoji) > 1 or len(tok.token_bytes(emoji[0])) == 4
    s = tok.stream()
    raw = b''.join(tok.token_bytes(i) for i in tok.encode('👩‍👩‍👧'))
    outs = [s.push(i) for i in tok.encode('👩‍👩‍👧')]
    assert ''.join(outs) == '👩‍👩‍👧' and len(raw) == 18

def test_decode_errors(tok):
    with pytest.raises(TokenizerError, match='49152'): tok.decode([49152])
    half = tok.encode('é')[:1] if len(tok.encode('é')) > 1 else [tok.vocab['Ã']]
    assert tok.decode(half) == '\ufffd'

def test_chat_template(tok):
    out = tok.apply_chat_template([{'role': 'user', 'content': 'Hi'}])
    assert out == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                   "trained by Hugging Face<|im_end|>\n"
                   "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    out = tok.apply_chat_template([{'role': 'system', 'content': 'Be brief.'},
                                   {'role': 'user', 'content': 'Hi'}],
                                  add_generation_prompt=False)
    assert out == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"

def test_chat_template_sandbox_and_errors():
    t = tokenizer.BPETokenizer([chr(c) for c in range(256)], [],
                               chat_template="{{ raise_exception('no') }}")
    with pytest.raises(TokenizerError, match='no'): t.apply_chat_template([])
    t.chat_template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(TokenizerError): t.apply_chat_template([])
    with pytest.raises(TokenizerError, match='no chat template'):
        tokenizer.BPETokenizer([chr(c) for c in range(256)], []).apply_chat_template([])

# ---------- chat templates on a budget ----------
@contextlib.contextmanager
def hang_guard(seconds=60):
    "Fail (instead of hanging the suite) if a case runs `seconds` of real time."
    def _alarm(*_): raise TimeoutError(f"still rendering after {seconds} s")
    old = signal.signal(signal.SIGALRM, _alarm); signal.setitimer(signal.ITIMER_REAL, seconds)
    try: yield
    finally: signal.setitimer(signal.ITIMER_REAL, 0); signal.signal(signal.SIGALRM, old)

HOSTILE = {   # template -> the words of the TokenizerError
    'nested loops emitting': ("{% for i in range(99999) %}{% for j in range(99999) %}"
                              "{{ 'x' * 99999 }}{% endfor %}{% endfor %}", 'rendered text exceeds'),
    'nested silent loops': ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}"
                            "{% endfor %}", 'max_steps'),
    'range 10**9': ("{% for i in range(10**9) %}{% endfor %}", 'exceeds max_output'),
    'range 10**9 literal': ("{{ range(1000000000)|list|length }}", 'exceeds max_output'),
    'doubling': ("{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                 "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}", 'exceeds max_output'),
    'list doubling': ("{% set ns = namespace(l=[1]) %}{% for i in range(64) %}"
                      "{% set ns.l = ns.l + ns.l %}{% endfor %}", 'exceeds max_output'),
    'repeat string': ("{{ 'x' * 10**10 }}", 'exceeds max_output'),
    'repeat list then join': ("{{ (['x' * 100000] * 100000)|join }}", 'exceeds max_output'),
    'power': ("{{ 7 ** 1000000000 }}", 'bits'),
    'squaring': ("{% set ns = namespace(n=7) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}"
                 "{% endfor %}", 'bits'),
    'center': ("{{ 'x'|center(10**10) }}", 'exceeds max_output'),
    'ljust method': ("{{ 'x'.ljust(10**10) }}", 'exceeds max_output'),
    'format filter width': ("{{ '%1000000000d'|format(1) }}", 'would build 1000000000'),
    'percent width': ("{{ '%1000000000d' % 1 }}", 'would build 1000000000'),
    'str.format width': ("{{ '{:>1000000000}'.format(1) }}", 'would build 10000000'),
    'recursion': ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", 'nested more than'),
    'attribute escape': ("{{ ''.__class__.__mro__[1].__subclasses__() }}", 'SecurityError'),
    'undefined call': ("{{ nothing() }}", 'UndefinedError'),
    'division by zero': ("{{ 1 // 0 }}", 'ZeroDivisionError'),
    'syntax': ("{% for %}", 'TemplateSyntaxError'),
}

@pytest.mark.parametrize('name', list(HOSTILE))
def test_hostile_chat_templates_are_bounded_and_typed(name):
    """Each hostile template ends in TokenizerError (never a raw exception, never a hang), within a
    bound on traced memory; no verdict depends on the clock."""
    template, words = HOSTILE[name]
    tracemalloc.start()
    try:
        with hang_guard(), pytest.raises(TokenizerError, match=words):
            tokenizer.render_chat_template(template, [])
        peak = tracemalloc.get_traced_memory()[1]
    finally: tracemalloc.stop()
    assert peak < 64 << 20, f"{name}: {peak / 2**20:.0f} MiB traced"

def test_chat_template_caps_are_configurable():
    many = [{'role': 'user', 'content': 'x' * 100}] * 50
    t = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    assert len(tokenizer.render_chat_template(t, many)) == 50 * 107
    with pytest.raises(TokenizerError, match='max_steps=20 '):
        tokenizer.render_chat_template(t, many, caps={'max_steps': 20})
    with pytest.raises(TokenizerError, match='max_output=1000'):
        tokenizer.render_chat_template(t, many, caps={'max_output': 1000})
    with pytest.raises(TypeError, match='max_widgets'):
        tokenizer.render_chat_template(t, many, caps={'max_widgets': 1})
    tk = tokenizer.BPETokenizer([chr(c) for c in range(256)], [], chat_template=t)
    with pytest.raises(TokenizerError, match='max_steps'):
        tk.apply_chat_template(many, caps={'max_steps': 20})
    assert sys.gettrace() is None or sys.gettrace() is not tokenizer._Budget._trace   # restored

def test_budget_restores_an_outer_tracer():
    seen = []
    def outer(frame, event, arg): seen.append(event); return None
    sys.settrace(outer)
    try: tokenizer.render_chat_template("{{ 1 + 1 }}", [])
    finally: now = sys.gettrace(); sys.settrace(None)
    assert now is outer

def test_from_gguf_needs_an_admitted_file():
    with pytest.raises(TokenizerError, match='open_gguf'): tokenizer.from_gguf('model.gguf')

def test_unsupported_models_refused():
    class G: metadata = {'tokenizer.ggml.model': 'bert'}
    with pytest.raises(TokenizerError, match="'bert' is not supported"): tokenizer.from_gguf(G())
    class H: metadata = {'tokenizer.ggml.model': 'gpt2', 'tokenizer.ggml.tokens': ['a'],
                         'tokenizer.ggml.merges': [],
                         'tokenizer.ggml.pre': 'mystery'}
    with pytest.raises(TokenizerError, match="pre-tokenizer 'mystery' is not supported"):
        tokenizer.from_gguf(H())
    with pytest.raises(TokenizerError, match=r'merges\[0\]'):
        tokenizer.BPETokenizer(['a'], ['abc'])

# ---------- pre-tokenizers of other GGUF models, against the tokenizers package ----------
# Each model's split expression as its tokenizer.json writes it (case-insensitive contractions,
# Oniguruma's engine in the tokenizers package); gradus writes its own (llama.cpp's spelling).
_GPT4_STYLE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|{digits}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
HF_SPLITS = {'llama-bpe': [_GPT4_STYLE.replace('{digits}', r'\p{N}{1,3}')],
             'qwen2': [_GPT4_STYLE.replace('{digits}', r'\p{N}')],
             'gpt2': [r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"
                      r"|\s+(?!\S)|\s+"]}
HF_SPLITS['smollm'] = [r'\p{N}'] + HF_SPLITS['gpt2']

def _hf_pieces(exprs, text):
    from tokenizers import Regex, pre_tokenizers
    seq = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(e), 'isolated') for e in exprs])
    return [p for p, _ in seq.pre_tokenize_str(text)]

EXTRA = ["'S 'T 'Re 'VE 'M 'LL 'D", "x'sy", "$var _name #tag", "12345678901", "a\r\n\r\nb",
         "?!\n\n\nx", "  \n  x", "\t\tx", "end.   ", "١٢٣٤ ௧௨௩", "Ⅻ½x²"]

def rare_lines(n, seed=5):
    """Characters drawn from all planes, kept where Unicode 14 (Python's unicodedata) assigns them:
    the `regex` module and the tokenizers package's Oniguruma follow different, newer Unicode
    versions, which classify characters added since differently (U+0C5C: a letter, or not)."""
    rng = np.random.default_rng(seed)
    draw = lambda: chr(int(rng.choice([rng.integers(0x20, 0x3000), rng.integers(0x3000, 0x30000)])))
    chars = lambda k: [c for c in (draw() for _ in range(k))
                       if unicodedata.category(c) not in ('Cn', 'Cs')]
    line = lambda k: ''.join(c + (' ' if rng.random() < 0.3 else '') for c in chars(k))
    return [line(int(rng.integers(1, 25))) for _ in range(n)]

@pytest.mark.parametrize('pre', ['llama-bpe', 'qwen2', 'gpt2', 'smollm'])
def test_pre_tokenizers_equal_tokenizers_package(pre, shakespeare):
    lines = (varied_lines(2000, seed=3) + rare_lines(500) + EXTRA
             + shakespeare[:20000].splitlines())
    exprs = tokenizer.PRE_TOKENIZERS[pre]
    for line in lines:
        assert tokenizer.pre_tokenize(line, exprs) == _hf_pieces(HF_SPLITS[pre], line), repr(line)

def test_pre_tokenizer_aliases_and_differences():
    P = tokenizer.PRE_TOKENIZERS
    assert P['llama3'] == P['llama-v3'] == P['llama-bpe'] and P['stablelm2'] == P['qwen2']
    cut = lambda pre, s: tokenizer.pre_tokenize(s, P[pre])
    assert cut('llama-bpe', '12345') == ['123', '45'] and cut('qwen2', '123') == ['1', '2', '3']
    assert cut('gpt2', '12345') == ['12345'] and cut('llama-bpe', "HE'LL") == ['HE', "'LL"]
    assert cut('llama-bpe', '$x') == ['$x'] and cut('gpt2', '$x') == ['$', 'x']

# ---------- the merge loop: a heap, proved equal to the definition, its cost counted ----------
def _byte_symbols(word):
    b2u = tokenizer.byte_to_unicode()
    return [b2u[b] for b in word.encode('utf-8')]

def test_heap_merge_equals_the_simple_loop_on_random_ranks():
    "Random words over a small alphabet, random merge tables (ties of one pair twice and all)."
    rng = np.random.default_rng(0)
    for trial in range(300):
        alphabet = list('abcd')[:int(rng.integers(1, 5))]
        merges = {f"{''.join(rng.choice(alphabet, int(rng.integers(1, 3))))} "
                  f"{''.join(rng.choice(alphabet, int(rng.integers(1, 3))))}" for _ in range(12)}
        ranks = tokenizer.parse_merges(sorted(merges, key=lambda m: rng.random()))
        for _ in range(10):
            word = list(rng.choice(alphabet, int(rng.integers(0, 40))))
            assert (tokenizer.bpe_merge(word, ranks)
                    == tokenizer.bpe_merge_simple(word, ranks)), (ranks, word)

def test_heap_merge_equals_the_simple_loop_on_smollm2(tok, shakespeare):
    "The real SmolLM2 merges: 3,000 Shakespeare words and 300 random words of rare characters."
    words = sorted({w for w in shakespeare[:200000].split()})[:3000] + varied_lines(300, seed=9)
    assert len(words) >= 3000
    for w in words:
        syms = _byte_symbols(w)
        assert tokenizer.bpe_merge(syms, tok.ranks) == tokenizer.bpe_merge_simple(syms, tok.ranks)

def test_heap_merge_cost_is_linear_in_heap_operations(tok):
    """Work counted, not timed: on a 16,000-letter word the heap does at most 3n pushes and 3n pops
    (each O(log n)), where the simple loop looks up about n²/8 pairs already at 2,000 letters."""
    rng = np.random.default_rng(1)
    for n in (1000, 4000, 16000):
        for word in ('a' * n, ''.join(rng.choice(list('etaoinshr'), n))):
            stats = {}
            tokenizer.bpe_merge(_byte_symbols(word), tok.ranks, stats)
            assert stats['pushes'] <= 3 * n and stats['pops'] <= 3 * n, (n, stats)
    simple = {}
    tokenizer.bpe_merge_simple(_byte_symbols('a' * 2000), tok.ranks, simple)
    assert simple['lookups'] > 2000 ** 2 / 8

def test_long_words_equal_tokenizers_package(tok, hf):
    "The 16,000-letter words the heap makes cheap, against the tokenizers package."
    rng = np.random.default_rng(2)
    for word in ('a' * 16000, ''.join(rng.choice(list('etaoinshr'), 16000)), 'ab' * 5000):
        assert tok.encode(word) == hf.encode(word, add_special_tokens=False).ids

def test_bad_vocabularies_raise():
    b2u = [chr(c) for c in range(256)]
    for args, words in [((b2u[:2] + [7], []), r'tokens\[2\] is int'),
                        ((b2u, [], [1, 1]), '256 tokens but 2 token_types'),
                        ((b2u, [], [9] * 256), r'token_types\[0\] = 9'),
                        ((b2u, [], None, 'gpt2', 256), 'bos_id 256 is out of range'),
                        ((b2u, ['ab c']), r"merges\[0\] 'ab c': a symbol"),
                        ((b2u, [], None, ['gpt2']), 'pre-tokenizer')]:
        with pytest.raises(TokenizerError, match=words): tokenizer.BPETokenizer(*args)
    assert tokenizer.BPETokenizer(b2u + ['ab'], ['a b'], pad_id=3).pad_id == 3
