"""Attacks on the tokenizers (issue 25, items 3 and 4): crafted GGUF tokenizer metadata, every key
`from_gguf` reads with every wrong GGUF type and out-of-range values, built byte by byte and
admitted by `open_gguf`; and hostile chat templates against the rendering budget. Each attack
ends in a typed error (`TokenizerError`, or `FormatError` for a malformed file) naming what is
wrong, or in a correct result. Bounded by work (small caps, counted operations), never by the
clock."""
import struct, tracemalloc
from collections import Counter
import numpy as np, pytest
from _gguf_build import (ARRAY, BOOL, FLOAT32, FLOAT64, INT8, INT16, INT32, INT64, STRING,
                         UINT8, UINT16, UINT32, UINT64, build, s, value)
from gradus.errors import FormatError, TokenizerError
from gradus.formats import gguf as G, spm, tokenizer as T

# ---------- GGUF metadata written by hand (tests/_gguf_build.py: types and `value`) ----------
INTS = (UINT8, INT8, UINT16, INT16, UINT32, INT32, UINT64, INT64)

def gguf_file(tmp_path, kvs, name='t.gguf'):
    "A tensorless GGUF file of `kvs` (`{key: (vtype, value)}`), admitted by `open_gguf`."
    blob, _ = build([s(k) + struct.pack('<I', t) + value(t, v) for k, (t, v) in kvs.items()], [])
    path = tmp_path / name
    path.write_bytes(blob)
    return G.open_gguf(path)

B2U = T.byte_to_unicode()
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

def bpe_base():
    "A valid byte-level BPE tokenizer: 256 byte symbols, four merges, three control tokens."
    tokens = [B2U[b] for b in range(256)] + ['lo', 'low', 'er', 'Ġlo', '<|endoftext|>',
                                             '<|im_start|>', '<|im_end|>']
    return {'tokenizer.ggml.model': (STRING, 'gpt2'), 'tokenizer.ggml.pre': (STRING, 'gpt2'),
            'tokenizer.ggml.tokens': (ARRAY, (STRING, tokens)),
            'tokenizer.ggml.token_type': (ARRAY, (INT32, [1] * 260 + [3, 3, 3])),
            'tokenizer.ggml.merges': (ARRAY, (STRING, ['l o', 'lo w', 'e r', 'Ġ lo'])),
            'tokenizer.ggml.bos_token_id': (UINT32, 261),
            'tokenizer.ggml.eos_token_id': (UINT32, 262),
            'tokenizer.ggml.padding_token_id': (UINT32, 260),
            'tokenizer.ggml.unknown_token_id': (UINT32, 0),
            'tokenizer.ggml.eot_token_id': (UINT32, 262),
            'tokenizer.ggml.eom_token_id': (UINT32, 260),
            'tokenizer.ggml.add_bos_token': (BOOL, False),
            'tokenizer.ggml.add_space_prefix': (BOOL, False),
            'tokenizer.chat_template': (STRING, CHATML)}

def spm_base():
    "A valid SentencePiece tokenizer: <unk>, <s>, </s>, 256 byte tokens, pieces with scores."
    pieces = ['▁', 'l', 'o', 'w', 'e', 'r', 'lo', 'low', '▁low', 'er']
    tokens = ['<unk>', '<s>', '</s>', *(spm.byte_token(b) for b in range(256)), *pieces]
    base = bpe_base()
    del base['tokenizer.ggml.merges'], base['tokenizer.ggml.pre']
    return {**base, 'tokenizer.ggml.model': (STRING, 'llama'),
            'tokenizer.ggml.tokens': (ARRAY, (STRING, tokens)),
            'tokenizer.ggml.scores': (ARRAY, (FLOAT32, [0.0] * 259 + [-9.0] * 6
                                                + [-1.0, -2.0, -3.0, -4.0])),
            'tokenizer.ggml.token_type': (ARRAY, (INT32, [2, 3, 3] + [6] * 256 + [1] * 10)),
            'tokenizer.ggml.bos_token_id': (UINT32, 1), 'tokenizer.ggml.eos_token_id': (UINT32, 2),
            'tokenizer.ggml.padding_token_id': (UINT32, 0),
            'tokenizer.ggml.eot_token_id': (UINT32, 2), 'tokenizer.ggml.eom_token_id': (UINT32, 2)}

BASES = {'gpt2': bpe_base, 'llama': spm_base}
TEXTS = ['lower lol', 'hi <|im_start|> 🙂 low', 'l' * 300, '', '<s></s> é']

def exercise(tok):
    "Encode, decode, stream and template: a typed error or ids inside the vocabulary."
    for text in TEXTS:
        for special in (False, True):
            try: ids = tok.encode(text, parse_special=special, add_bos=True)
            except TokenizerError: continue
            assert all(0 <= i < tok.vocab_size for i in ids), (text, ids)
            st = tok.stream()
            assert ''.join(st.push(i) for i in ids) + st.flush() == tok.decode(ids)
    if tok.chat_template:
        try: tok.apply_chat_template([{'role': 'user', 'content': 'hi'}])
        except TokenizerError: pass

def outcome(tmp_path, kvs):
    "`('ok', tokenizer)`, or `('refused', message)` for a TokenizerError or FormatError."
    try: g = gguf_file(tmp_path, kvs)
    except FormatError as e: return 'refused', f"FormatError: {e}"
    try: tok = T.from_gguf(g)
    except TokenizerError as e: return 'refused', str(e)
    exercise(tok)
    return 'ok', tok

# every GGUF type, with a value that would be right had the type been right
TYPED = {'UINT8': (UINT8, 1), 'INT8': (INT8, 1), 'UINT16': (UINT16, 1), 'INT16': (INT16, 1),
         'UINT32': (UINT32, 1), 'INT32': (INT32, 1), 'UINT64': (UINT64, 1), 'INT64': (INT64, 1),
         'FLOAT32': (FLOAT32, 1.0), 'FLOAT64': (FLOAT64, 1.0), 'BOOL': (BOOL, True),
         'STRING': (STRING, '1'), 'ARRAY[UINT32]': (ARRAY, (UINT32, [1, 2])),
         'ARRAY[INT8]': (ARRAY, (INT8, [1])), 'ARRAY[FLOAT32]': (ARRAY, (FLOAT32, [1.0])),
         'ARRAY[BOOL]': (ARRAY, (BOOL, [True])), 'ARRAY[STRING]': (ARRAY, (STRING, ['a b'])),
         'ARRAY[ARRAY]': (ARRAY, (ARRAY, [(UINT32, [1])])), 'ARRAY[empty]': (ARRAY, (INT32, []))}
FITS = {   # the GGUF types a key's kind accepts (the value may still be refused: length, range)
    'str': {'STRING'}, 'bool': {'BOOL'}, 'id': {t for t in TYPED if t[0] in 'UI' and '[' not in t},
    'strings': {'ARRAY[STRING]'}, 'integers': {'ARRAY[UINT32]', 'ARRAY[INT8]', 'ARRAY[empty]'},
    'numbers': {'ARRAY[UINT32]', 'ARRAY[INT8]', 'ARRAY[FLOAT32]', 'ARRAY[empty]'}}

@pytest.mark.parametrize('model', ['gpt2', 'llama'])
def test_every_key_with_every_wrong_type(model, tmp_path):
    """Each key `from_gguf` reads (`tokenizer._KINDS`), given each GGUF type: a type that does not
    fit the key's kind is refused by a TokenizerError naming the key; one that fits gives a
    working tokenizer or a typed refusal."""
    base, tally = BASES[model](), Counter()
    keys = [k for k in T._KINDS if k in base or model == 'gpt2' or 'merges' not in k]
    assert set(base) <= set(T._KINDS) and len(keys) >= 14
    for key in keys:
        for tname, typed in TYPED.items():
            kind, got = T._KINDS[key], outcome(tmp_path, {**base, key: typed})
            if tname not in FITS[kind]:
                assert got[0] == 'refused' and key in got[1], (key, tname, got)
                assert 'FormatError' not in got[1]
            tally[got[0]] += 1
    assert tally['refused'] + tally['ok'] == len(keys) * len(TYPED)
    print(f"\n{model}: {sum(tally.values())} wrong-type attacks: {dict(tally)}")

def out_of_range(model, n):
    "(key, typed value) pairs outside what the key allows; `n` tokens in the base vocabulary."
    ids = [k for k in T._KINDS if k.endswith('_token_id')]
    cases = [(k, v) for k in ids for v in [(UINT32, n), (UINT32, 2**32 - 1), (INT32, -1),
                                          (INT64, -2**63), (UINT64, 2**64 - 1), (UINT32, 10**9)]]
    tt = 'tokenizer.ggml.token_type'
    cases += [(tt, (ARRAY, (INT32, [1] * (n - 1)))), (tt, (ARRAY, (INT32, [1] * (n + 1)))),
              (tt, (ARRAY, (INT32, [7] * n))), (tt, (ARRAY, (INT32, [-1] * n))),
              (tt, (ARRAY, (UINT8, [255] * n)))]
    tk = 'tokenizer.ggml.tokens'
    cases += [(tk, (ARRAY, (STRING, []))), ('tokenizer.ggml.model', (STRING, 'bert')),
              ('tokenizer.ggml.model', (STRING, ''))]
    if model == 'gpt2':
        m = 'tokenizer.ggml.merges'
        cases += [(m, (ARRAY, (STRING, bad))) for bad in
                  (['abc'], ['a  b'], ['a b c'], ['l x'], ['q z'], ['', 'l o'])]
        cases += [('tokenizer.ggml.pre', (STRING, p)) for p in ('mystery', '', 'GPT2')]
    else:
        sc = 'tokenizer.ggml.scores'
        cases += [(sc, (ARRAY, (FLOAT32, [0.0] * (n - 1)))),
                  (sc, (ARRAY, (FLOAT32, [float('nan')] * n))),
                  (tk, (ARRAY, (STRING, ['<unk>'] * n)))]      # duplicate texts
    return cases

@pytest.mark.parametrize('model', ['gpt2', 'llama'])
def test_out_of_range_values_are_refused_naming_the_key(model, tmp_path):
    base = BASES[model]()
    n = len(base['tokenizer.ggml.tokens'][1][1])
    cases = out_of_range(model, n)
    for key, typed in cases:
        got = outcome(tmp_path, {**base, key: typed})
        assert got[0] == 'refused' and key in got[1], (key, typed, got)
    print(f"\n{model}: {len(cases)} out-of-range attacks, all refused naming the key")

def test_the_issues_reproductions(tmp_path):
    "The cases of issue 25 item 3, each a TokenizerError naming the key (no builtin exception)."
    base = bpe_base()
    for key, typed, words in [
            ('tokenizer.ggml.merges', (ARRAY, (UINT32, [1, 2])), 'merges must be an array of str'),
            ('tokenizer.ggml.token_type', (ARRAY, (INT32, [1] * 5)),
             '263 tokenizer.ggml.tokens but'),
            ('tokenizer.ggml.tokens', (ARRAY, (UINT32, [1, 2])), 'tokens must be an array of str'),
            ('tokenizer.ggml.bos_token_id', (UINT32, 10**9), 'bos_token_id 1000000000 is out of'),
            ('tokenizer.ggml.bos_token_id', (INT32, -1), 'bos_token_id -1 is out of range')]:
        got = outcome(tmp_path, {**base, key: typed})
        assert got[0] == 'refused' and words in got[1], (key, got)

def test_malformed_files_are_format_errors(tmp_path):
    "A BOOL byte of 2, a string that is not UTF-8: the file is wrong, a FormatError names the key."
    for raw, words in [(s('tokenizer.ggml.add_bos_token') + struct.pack('<IB', BOOL, 2), 'bool'),
                       (s('tokenizer.ggml.pre') + struct.pack('<IQ', STRING, 2) + b'\xff\xfe',
                        'UTF-8')]:
        blob, _ = build([raw], [])
        (tmp_path / 'bad.gguf').write_bytes(blob)
        with pytest.raises(FormatError, match=words): G.open_gguf(tmp_path / 'bad.gguf')

def test_hostile_vocabularies(tmp_path, monkeypatch):
    """Special tokens that once crashed or could hang: a 2,000-character CONTROL token works (no
    recursion), an empty one never matches, a chain of 300 nested prefixes is refused, and so is a
    vocabulary whose special texts exceed `SPECIAL_CAPS['max_text']`."""
    base = bpe_base()
    tokens = base['tokenizer.ggml.tokens'][1][1]
    n = len(tokens)
    def with_specials(extra):
        return {**base, 'tokenizer.ggml.tokens': (ARRAY, (STRING, tokens + extra)),
                'tokenizer.ggml.token_type': (ARRAY, (INT32, [1] * 260 + [3] * (3 + len(extra))))}
    kind, tok = outcome(tmp_path, with_specials(['x' * 2000, '']))
    assert kind == 'ok' and tok.encode('a' + 'x' * 2000 + 'b', parse_special=True)[1] == n
    assert tok.encode('ab', parse_special=True) == [tok.vocab['a'], tok.vocab['b']]
    kind, msg = outcome(tmp_path, with_specials(['<' * k for k in range(1, 300)]))
    assert kind == 'refused' and 'nest' in msg and 'max_nesting' in msg
    monkeypatch.setitem(spm.SPECIAL_CAPS, 'max_text', 1000)
    kind, msg = outcome(tmp_path, with_specials(['<t%04d>' % i for i in range(200)]))
    assert kind == 'refused' and 'max_text=1000' in msg

def test_accepted_types_give_the_same_tokenizer(tmp_path):
    "An id of any integer width, scores as integers: the same tokenizer as the base file's."
    base, ref = bpe_base(), None
    ref = T.from_gguf(gguf_file(tmp_path, base, 'ref.gguf'))
    for t in INTS:
        tok = T.from_gguf(gguf_file(tmp_path, {**base, 'tokenizer.ggml.bos_token_id': (t, 100)}))
        assert tok.bos_id == 100 and tok.encode('lower lol') == ref.encode('lower lol')
    sb = spm_base()
    sc = sb['tokenizer.ggml.scores'][1][1]
    tok = T.from_gguf(gguf_file(tmp_path, {**sb, 'tokenizer.ggml.scores':
                                           (ARRAY, (INT32, [int(x) for x in sc]))}))
    assert [tok.tokens[i] for i in tok.encode(' lower')] == ['▁low', 'er']
    assert tok.encode(' lower lé') == T.from_gguf(gguf_file(tmp_path, sb)).encode(' lower lé')

def test_random_metadata_fuzz(tmp_path):
    """Random combinations: each key replaced, with probability 1/3, by a random typed value (any
    GGUF type, random ints and strings): a typed refusal or a working tokenizer, always."""
    rng, tally = np.random.default_rng(0), Counter()
    def random_value():
        t = rng.choice(list(TYPED))
        vt, v = TYPED[t]
        lo, hi = {UINT8: (0, 256), INT8: (-5, 100)}.get(vt, (-5 * (t[0] == 'I'), 300))
        if vt in INTS: v = int(rng.integers(lo, hi))
        if vt == STRING: v = ''.join(rng.choice(list('ab <|>gpt2lam'), rng.integers(0, 8)))
        return vt, v
    for i in range(150):
        model = ('gpt2', 'llama')[i % 2]
        kvs = {k: (random_value() if rng.random() < 1 / 3 else v)
               for k, v in BASES[model]().items()}
        tally[outcome(tmp_path, kvs)[0]] += 1
    assert sum(tally.values()) == 150 and tally['refused'] > 50
    print(f"\nrandom metadata: 150 files: {dict(tally)}")

# ---------- chat templates against the budget ----------
FAST = {'max_work': 100_000}          # a small budget: refusals in milliseconds
S = "{% set s = 'x' * 4000000 %}"     # a 4-million-character string (just under max_output)
TEMPLATE_ATTACKS = {   # name -> (template, caps, words of the TokenizerError or ('ok', result))
    'lipsum 4e6': ("{{ lipsum(4000000) }}", None, 'lipsum would build'),
    'lipsum max': ("{{ lipsum(1, max=10**9) }}", None, 'exceeds max_output'),
    'lipsum fine': ("{{ lipsum(2, html=False, min=5, max=9)|wordcount > 5 }}", None,
                    ('ok', 'True')),
    'map chain': ("{{ range(100000)" + "|map('string')" * 40 + "|list|length }}", FAST,
                  'max_work=100000'),
    'map chain default': ("{{ range(100000)" + "|map('string')" * 40 + "|first }}", None,
                          ('ok', '0')),                   # lazy: one item through 40 maps
    'select chain': ("{{ range(100000)|select|select|reject|list|length }}", FAST, 'max_work'),
    'generator loop': ("{% for x in range(100000)|map('abs') %}{% endfor %}", FAST, 'max_work'),
    'star width': ("{{ '%*d' % (3000000000, 1) }}", None, "'%' would build 3000000000"),
    'star precision': ("{{ '%.*f' % (3000000000, 1.0) }}", None, "would build"),
    'star both': ("{{ '%*.*d' % (5, 3000000000, 1) }}", None, "would build"),
    'two widths': ("{{ '%-4000000s%-4000000s' % ('a', 'b') }}", None, 'would build 8000000'),
    'nested key': ("{{ '%(a(b)c)3000000000d' % {'a(b)c': 1} }}", None, 'would build'),
    'percent ok': ("{{ '%c%5.1f|%-3s|%*d' % (65, 2.25, 'x', 3, 7) }}", None,
                   ('ok', 'A  2.2|x  |  7')),
    'format filter star': ("{{ '%*d%*d'|format(3000000, 1, 3000000, 1) }}", None,
                           'filter format would build 6000000'),
    'format filter huge': ("{{ '%*d'|format(3000000000, 1) }}", None, 'exceeds max_output'),
    'format filter key': ("{{ '%(x)3000000000s'|format(x=1) }}", None, 'would build'),
    'str.format nested': ("{{ '{:{}}'.format(1, 3000000) }}{{ '{:{}}'.format(1, 3000000) }}",
                          None, 'exceeds max_output'),
    'str.format fields': (S + "{{ '{0}{0}{0}'.format(s) }}", None, 'str.format would build'),
    'str.format map': ("{{ '{a:{w}}'.format_map({'a': 1, 'w': 3000000000}) }}", None,
                       'would build'),
    'str.format ok': ("{{ '{:>5}|{:.2f}|{w}'.format('ab', 3.14159, w=7) }}", None,
                      ('ok', '   ab|3.14|7')),
    'replace empty': ("{{ ('x' * 1000000)|replace('', 'yyyy') }}", None, 'filter replace would'),
    'replace method': ("{{ ('x' * 1000000).replace('x', 'yyyyyyy') }}", None, 'method replace'),
    'replace count': ("{{ ('ab' * 1000000)|replace('a', 'c' * 10, 3)|length }}", None,
                      ('ok', str(2000000 + 27))),
    'indent': ("{{ ('x\n' * 1000000)|indent(100) }}", None, 'filter indent would build'),
    'indent string': ("{{ ('x\n' * 100000)|indent('y' * 100) }}", None, 'filter indent would'),
    'indent blank lines': ("{{ ('\n' * 20000)|indent(100)|length }}", None, ('ok', '20000')),
    'indent ok': ("{{ 'a\nb'|indent(2, first=True) }}", None, ('ok', '  a\n  b')),
    'center': ("{{ 'x'|center(4000000) }}{{ 'x'|center(4000000) }}", None, 'exceeds max_output'),
    'ljust zfill': ("{{ 'x'.ljust(3000000) ~ 'x'.zfill(3000000) }}", None, 'exceeds max_output'),
    'expandtabs': ("{{ ('\t' * 1000000).expandtabs(100) }}", None, 'method expandtabs would'),
    'translate': ("{{ ('a' * 1000000).translate({97: 'b' * 100}) }}", None, 'method translate'),
    'join separator': ("{{ range(10000)|join('y' * 1000) }}", None, 'filter join would build'),
    'join method': ("{{ ('y' * 1000).join(('x' * 10000)|list) }}", None,
                    'method join would build'),
    'list of large strings': (S + "{{ [s, s, s, s] }}", None, 'an output value of size'),
    'join large strings': (S + "{{ [s, s, s, s]|join }}", None, 'filter join'),
    'tilde': (S + "{{ [s, s] ~ '' }}", None, "operands of '~'"),
    'plus strings': (S + "{{ s + s }}", None, "'+' would build"),
    'list times': (S + "{{ [s] * 2 }}", None, "'*' would build"),
    'set block': (S + "{% set b %}{% for i in range(100) %}{{ s }}{% endfor %}{% endset %}"
                  "{{ b|length }}", None, 'captured output would build'),
    'macro output': (S + "{% macro m() %}{{ s }}{{ s }}{% endmacro %}{{ m()|length }}", None,
                     'captured output'),
    'filter block': (S + "{% filter upper %}{{ s }}{{ s }}{% endfilter %}", None, 'captured'),
    'call block': (S + "{% macro m() %}{{ caller() }}{{ caller() }}{% endmacro %}"
                   "{% call m() %}{{ s }}{% endcall %}", None, 'captured output'),
    'literal block': ("{% set b %}{% for i in range(10000) %}" + "L" * 1000 + "{% endfor %}"
                      "{% endset %}{{ b|length }}", None, 'captured output would build'),
    'namespace': (S + "{% set ns = namespace(a=s, b=s) %}{{ ns }}", None, 'an output value'),
    'dict fromkeys': (S + "{% set d = {}.fromkeys(range(100000), s) %}{{ d|length }}{{ d }}",
                      None, 'an output value'),
    'sum of lists': ("{{ (range(10000)|batch(1)|list)|sum(start=[])|length }}", None,
                     'max_work'),
    'split': ("{{ ('a,' * 2000000).split(',')|length }}", None, 'method split would build'),
    'list of chars': ("{{ ('x' * 1000000)|list|length }}", None, 'filter list would build'),
    'batch fill': ("{{ [1]|batch(4000000, 0)|list|length }}", None, 'filter batch would build'),
    'slice fill': ("{{ [1]|slice(4000000, 0)|list|length }}", None, 'filter slice would build'),
    'tojson indent': ("{{ range(1000)|list|tojson(indent=100000) }}", None, 'filter tojson'),
    'wordwrap': ("{{ ('x ' * 100000)|wordwrap(1, wrapstring='y' * 1000) }}", None,
                 'filter wordwrap'),
    'urlize': ("{{ ('www.example.com ' * 100000)|urlize(target='t' * 100) }}", None,
               'filter urlize'),
    'nested lists': ("{% set ns = namespace(l=[]) %}{% for i in range(1500) %}"
                     "{% set ns.l = [ns.l] %}{% endfor %}{{ ns.l }}", None, 'Recursion'),
    'recursive macro': ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", None,
                        'nested more than'),
    'power': ("{{ 2 ** 100000 }}", None, 'bits'),
    'to_bytes': ("{{ (1).to_bytes(10**9, 'big') }}", None, 'exceeds max_output'),
    'range 10**9': ("{{ range(10**9)|length }}", None, 'exceeds max_output'),
    'silent loops': ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}"
                     "{% endfor %}", None, 'max_steps'),
    'deadline': ("{% for i in range(10) %}{{ i }}{% endfor %}", {'max_seconds': -1},
                 'max_seconds=-1'),
    'escape': ("{{ ''.__class__.__mro__[1].__subclasses__() }}", None, 'SecurityError'),
    'friendly': (CHATML, None, ('ok', "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")),
}

def test_template_attacks():
    """Every template attack: a TokenizerError with the expected words, or the correct text; the
    peak of traced allocations stays under 48 MiB for each (the refusals come before building)."""
    handled = 0
    for name, (template, caps, want) in TEMPLATE_ATTACKS.items():
        tracemalloc.start()
        try:
            try: got = ('ok', T.render_chat_template(template, [{'role': 'user', 'content': 'hi'}],
                                                     caps=caps))
            except TokenizerError as e: got = ('error', str(e))
            peak = tracemalloc.get_traced_memory()[1]
        finally: tracemalloc.stop()
        if isinstance(want, tuple): assert got == want, (name, got[1][:200])
        else: assert got[0] == 'error' and want in got[1], (name, got[1][:200])
        assert peak < 48 << 20, f"{name}: {peak / 2**20:.0f} MiB traced"
        handled += 1
    assert handled == len(TEMPLATE_ATTACKS) >= 60
    print(f"\n{handled} template attacks, all handled")

def test_the_work_budget_counts_filters_and_generators():
    """The same 3,000 items pulled through 1, 2, 4 chained `map` filters: the work counted grows
    with the filters (every generator step is counted), though the template's steps do not."""
    works, steps = [], []
    orig = T._Budget.__exit__
    def record(self, *exc):
        works.append(self.work); steps.append(self.steps)
        return orig(self, *exc)
    try:
        T._Budget.__exit__ = record
        for k in (1, 2, 4):
            T.render_chat_template("{{ range(3000)" + "|map('abs')" * k + "|list|length }}", [],
                                   caps={'max_work': 10**7})
    finally: T._Budget.__exit__ = orig
    assert steps[0] == steps[1] == steps[2]
    assert works[1] > 1.7 * works[0] and works[2] > 1.7 * works[1] and works[0] > 3000 * 3

def test_deadline_reads_the_given_clock():
    "The deadline with a clock that advances one second per reading: refused at the 11th reading."
    ticks = iter(range(10**6))
    b = T._Budget({**T.TEMPLATE_CAPS, 'max_seconds': 10}, clock=lambda: next(ticks))
    b.deadline = b.clock() + 10
    with pytest.raises(T._OverBudget, match='max_seconds=10'):
        for _ in range(100): b.charge(256)
    assert next(ticks) == 12          # readings 0 (start) .. 11 (the one past the deadline)
