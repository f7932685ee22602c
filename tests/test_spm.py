"""SentencePiece BPE (gradus.formats.spm): Gemma 3's tokenizer against the `sentencepiece` package
(the
reference implementation, built from the same pieces, scores and types) and against llama.cpp
where `llama_cpp` is importable; small vocabularies against `sentencepiece` for ties, unused
pieces and the space prefix; `tokenizer.from_gguf` for both tokenizer models."""
import os, struct
from pathlib import Path
import numpy as np, pytest
from gradus.formats import gguf as G, tokenizer
from gradus.errors import TokenizerError
from gradus.formats.spm import (SentencePieceBPE, NORMAL, UNKNOWN, CONTROL, USER_DEFINED,
                        UNUSED, BYTE, byte_token, _alternation, cut_special)

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get('GRADUS_DATA', ROOT.parent / 'shared' / 'data'))

# ---------- the reference: a SentencePiece ModelProto written by hand (protobuf wire format) ---
def _varint(n):
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0)); n >>= 7
        if not n: return bytes(out)

def _field(f, payload): return _varint(f << 3 | 2) + _varint(len(payload)) + payload
def _num(f, v): return _varint(f << 3) + _varint(int(v))

def model_proto(pieces, scores, types, unk_id, add_dummy_prefix=False):
    """sentencepiece_model.proto: ModelProto{1: pieces{1 piece, 2 score (float), 3 type},
    2: TrainerSpec{3 model_type=BPE(2), 35 byte_fallback, 40 unk_id}, 3: NormalizerSpec{1 name,
    3 add_dummy_prefix, 4 remove_extra_whitespaces, 5 escape_whitespaces}}."""
    types = [UNKNOWN if i == unk_id else int(k) for i, k in enumerate(types)]
    piece = lambda p, s, k: _field(1, p.encode()) + b'\x15' + struct.pack('<f', s) + _num(3, k)
    body = b''.join(_field(1, piece(p, s, k)) for p, s, k in zip(pieces, scores, types))
    trainer = _num(3, 2) + _num(35, BYTE in types) + _num(40, unk_id)
    norm = _field(1, b'identity') + _num(3, add_dummy_prefix) + _num(4, 0) + _num(5, 1)
    return body + _field(2, trainer) + _field(3, norm)

def sentencepiece_of(pieces, scores, types, unk_id, **kw):
    sp = pytest.importorskip('sentencepiece', reason='the sentencepiece package (dev extra) is '
                             'the reference implementation; not installed')
    return sp.SentencePieceProcessor(model_proto=model_proto(pieces, scores, types, unk_id, **kw))

def cut_user_defined(text, user):
    """Leftmost-longest scan for user-defined texts (`{text: id}`): a list of str and ids. Written
    independently of gradus's regular-expression cut."""
    by_first = {}
    for t in sorted(user, key=len, reverse=True): by_first.setdefault(t[0], []).append(t)
    out, start, i = [], 0, 0
    while i < len(text):
        hit = next((t for t in by_first.get(text[i], ()) if text.startswith(t, i)), None)
        if hit is None: i += 1; continue
        out += [text[start:i], user[hit]]; i += len(hit); start = i
    return out + [text[start:]]

# ---------- lines ----------
FRAGMENTS = ["café", "naïve", "Ångström", "jalapeño", "日本語のテキスト", "東京", "中文分词",
             "한국어", "Привет, мир", "Ελληνικά", "مرحبا", "שלום", "हिन्दी", "ภาษาไทย", "🙂",
             "👩\u200d👩\u200d👧",
             "🇫🇷", "🎉🎉", "3.14159", "1,000,000", "2024-01-31", "007", "½", "x²", "Ⅻ", "٣٤",
             "don't", "I'll", "WE'RE", "def f(x):\n    return x**2", "<b>bold</b>", "</td>",
             "<start_of_turn>", "<end_of_turn>", "<bos>", "<0x41>", "▁", "a▁b", "...", "—", "«q»",
             "ß", "ﬁ", "\u200b", "\ufeff", "e\u0301", "\u00a0", "\u3000", "$9.99", "C++", "@user"]
SEPS = [' ', '', '  ', '   ', ' ' * 7, ' ' * 33, '\n', '\n\n', '\n\n\n\n', '\r\n', '\t', '\t\t',
        ' \t \n', ', ', '\n  ']
RARE = [(0x80, 0x2FF), (0x300, 0x36F), (0x370, 0x52F), (0x590, 0x6FF), (0x900, 0xDFF),
        (0x1100, 0x11FF), (0x2000, 0x2BFF), (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3),
        (0xE000, 0xF8FF), (0xFE00, 0xFE0F), (0x10000, 0x1013F), (0x1D400, 0x1D7FF),
        (0x1F300, 0x1FAFF), (0x20000, 0x2A6DF), (0xE0000, 0xE007F), (0xF0000, 0xF00FF), (1, 31)]

def varied_lines(n, seed=0):
    "Fragments (scripts, digits, emoji, specials) joined by whitespace runs, deterministically."
    rng = np.random.default_rng(seed)
    return [''.join(FRAGMENTS[rng.integers(len(FRAGMENTS))] + SEPS[rng.integers(len(SEPS))]
                    for _ in range(rng.integers(1, 12))) for _ in range(n)]

def rare_lines(n, seed=1):
    "Code points from rare ranges (combining marks, PUA, astral planes, controls), and words."
    rng = np.random.default_rng(seed)
    def char():
        lo, hi = RARE[rng.integers(len(RARE))]
        return chr(int(rng.integers(lo, hi + 1)))
    return [''.join(char() if rng.random() < 0.6 else FRAGMENTS[rng.integers(len(FRAGMENTS))]
                    + SEPS[rng.integers(len(SEPS))] for _ in range(rng.integers(1, 16)))
            for _ in range(n)]

LINES = varied_lines(2000) + rare_lines(1000)

# ---------- Gemma 3 ----------
@pytest.fixture(scope='module')
def gemma():
    try: path = G.gemma3_path()
    except FileNotFoundError as e:
        pytest.skip(f"Gemma 3 GGUF absent (install the gemma extra): {e}")
    g = G.open_gguf(path)
    return g, tokenizer.from_gguf(g)

@pytest.fixture(scope='module')
def reference(gemma):
    _, tok = gemma
    return sentencepiece_of(tok.tokens, tok.scores.tolist(), tok.token_types, tok.unk_id)

@pytest.fixture(scope='module')
def shakespeare_lines():
    p = DATA / 'tinyshakespeare.txt'
    if not p.exists(): pytest.skip(f"Tiny Shakespeare not found at {p} (set GRADUS_DATA)")
    return p.read_text(encoding='utf-8').splitlines()

def reference_ids(ref, tok, line):
    "SentencePiece on the text between user-defined tokens (which llama.cpp and HF cut out first)."
    user = {t: i for t, i in tok._special.items() if tok.token_types[i] == USER_DEFINED}
    return [i for c in cut_user_defined(line, user)
            for i in ([c] if isinstance(c, int) else ref.encode(c) if c else [])]

def test_gemma_from_gguf(gemma):
    g, tok = gemma
    assert isinstance(tok, tokenizer.SPMTokenizer) and isinstance(tok, SentencePieceBPE)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.unk_id) == (262144, 2, 1, 3)
    assert tok.add_bos is True and tok.add_space_prefix is False
    assert {1, tok.vocab['<end_of_turn>']} <= tok.eog_ids and len(tok._byte) == 256
    assert tok.encode('Hello', add_bos=tok.add_bos)[0] == 2
    with pytest.raises(TokenizerError, match='no chat template'):
        tok.apply_chat_template([{'role': 'user', 'content': 'hi'}])

def test_gemma_ids_equal_sentencepiece(gemma, reference):
    _, tok = gemma
    assert len(LINES) >= 3000
    for line in LINES:
        assert tok.encode(line) == reference_ids(reference, tok, line), repr(line)

def test_gemma_shakespeare_equal_sentencepiece(gemma, reference, shakespeare_lines):
    _, tok = gemma
    page = '\n'.join(shakespeare_lines[:400])            # one long text, newlines and all
    assert tok.encode(page) == reference_ids(reference, tok, page)
    for line in shakespeare_lines[::8]:                  # ~5,000 lines
        assert tok.encode(line) == reference_ids(reference, tok, line), repr(line)

def test_gemma_decode_round_trips(gemma, shakespeare_lines):
    _, tok = gemma
    assert tok.decode(tok.encode('a▁b')) == 'a b'     # a literal ▁ comes back as a space
    for line in [s for s in LINES if '▁' not in s] + shakespeare_lines[:2000]:
        ids = tok.encode(line, add_bos=True)
        assert tok.decode(ids[1:]) == line, repr(line)
        s = tok.stream()
        assert ''.join(s.push(i) for i in ids[1:]) + s.flush() == line, repr(line)

def test_gemma_byte_fallback_and_specials(gemma):
    _, tok = gemma
    ids = tok.encode('𝔘')                                 # not a piece: four byte tokens
    assert [tok.tokens[i] for i in ids] == ['<0xF0>', '<0x9D>', '<0x94>', '<0x98>']
    s = tok.stream()
    assert [s.push(i) for i in ids] == ['', '', '', '𝔘']
    turn = '<start_of_turn>user\nhi<end_of_turn>'
    assert tok.encode(turn, parse_special=True)[:2] == [tok.vocab['<start_of_turn>'],
                                                       tok.vocab['user']]
    assert tok.vocab['<start_of_turn>'] not in tok.encode(turn)    # control: only when asked
    assert tok.encode('a  b')[1] == tok.vocab['  '] == 138        # user-defined: always

def test_gemma_same_as_llama_cpp(gemma, shakespeare_lines):
    "The whole pipeline (special tokens, BOS) against llama.cpp reading the same GGUF file."
    llama_cpp = pytest.importorskip('llama_cpp', reason='llama-cpp-python not installed')
    g, tok = gemma
    ref = llama_cpp.Llama(str(G.gemma3_path()), vocab_only=True, verbose=False)
    for line in LINES[:1500] + shakespeare_lines[:1000]:
        for special in (False, True):
            assert (tok.encode(line, parse_special=special, add_bos=True)
                    == ref.tokenize(line.encode(), add_bos=True, special=special)), repr(line)

def test_gemma_text_streams_through_generate(gemma):
    "decode.generate drives the tokenizer as it would the model's: streaming, end of turn stops."
    from gradus.lm import decode
    _, tok = gemma
    want = tok.encode('Ein 𝔘 café! 東京') + [tok.vocab['<end_of_turn>'], 99]
    def step(tokens, pos):                   # logits for the token after position pos+n-1
        z = np.zeros(tok.vocab_size, np.float32)
        z[want[pos + len(tokens) - 1]] = 30.0
        return z
    g = decode.generate(step, [tok.bos_id], decode.GenerationConfig(temperature=0), tok)
    texts = [e.text for e in g]
    assert g.text == ''.join(texts) == 'Ein 𝔘 café! 東京' and g.stop_reason == 'eog'
    assert '' in texts                       # the byte tokens of 𝔘 held back until complete

# ---------- small vocabularies: ties, unused pieces, the space prefix ----------
def small_vocab(seed, n_pieces=60, unused=0.0):
    "<unk>, 256 byte tokens, the characters of '▁abcd', then random substrings with tied scores."
    rng = np.random.default_rng(seed)
    chars = list('▁abcd')
    pieces = set()
    while len(pieces) < n_pieces:
        k = int(rng.integers(2, 6))
        pieces.add(''.join(chars[i] for i in rng.integers(0, 5, k)))
    pieces = sorted(pieces)
    toks = ['<unk>', *(byte_token(b) for b in range(256)), *chars, *pieces]
    types = [UNKNOWN] + [BYTE] * 256 + [NORMAL] * 5 + [UNUSED if rng.random() < unused else NORMAL
                                                       for _ in pieces]
    scores = [0.0] * 257 + [-100.0] * 5 + [float(rng.integers(-6, 0)) for _ in pieces]  # ties
    return toks, scores, types

def random_texts(n, seed):
    rng = np.random.default_rng(seed)
    return [''.join(rng.choice(list(' abcdé'), int(rng.integers(1, 30)))) for _ in range(n)]

@pytest.mark.parametrize('seed', range(6))
def test_small_vocab_ties_equal_sentencepiece(seed):
    toks, scores, types = small_vocab(seed)
    ref, tok = sentencepiece_of(toks, scores, types, 0), SentencePieceBPE(toks, scores, types)
    for text in random_texts(300, seed):
        assert tok.encode(text) == ref.encode(text), repr(text)

@pytest.mark.parametrize('seed', range(6))
def test_small_vocab_unused_pieces_equal_sentencepiece(seed):
    toks, scores, types = small_vocab(seed, unused=0.3)
    assert UNUSED in types
    ref, tok = sentencepiece_of(toks, scores, types, 0), SentencePieceBPE(toks, scores, types)
    for text in random_texts(300, seed):
        assert tok.encode(text) == ref.encode(text), repr(text)

def test_small_vocab_space_prefix_equal_sentencepiece():
    toks, scores, types = small_vocab(7)
    ref = sentencepiece_of(toks, scores, types, 0, add_dummy_prefix=True)
    tok = SentencePieceBPE(toks, scores, types, add_space_prefix=True)
    for text in random_texts(300, 7):
        ids = tok.encode(text)
        assert ids == ref.encode(text), repr(text)
        assert tok.decode(ids) == text == ref.decode(ids)

# ---------- the special-token cut: a trie expression, leftmost-longest ----------
def test_special_token_trie_equals_a_plain_scan():
    rng = np.random.default_rng(0)
    for _ in range(300):
        words = {''.join(rng.choice(list('ab<'), int(rng.integers(1, 5)))) for _ in range(6)}
        special = {w: i for i, w in enumerate(sorted(words))}
        text = ''.join(rng.choice(list('ab<c'), 30))
        assert (cut_special(text, _alternation(special), special)
                == cut_user_defined(text, special)), (words, text)

# ---------- errors, dispatch ----------
def test_no_byte_fallback_gives_unk_or_raises():
    toks, scores, types = ['<unk>', '▁', 'a'], [0.0, -1.0, -1.0], [UNKNOWN, NORMAL, NORMAL]
    assert SentencePieceBPE(toks, scores, types, unk_id=0).encode('a é') == [2, 1, 0]
    with pytest.raises(TokenizerError, match="'é'.*neither byte fallback nor an unknown token"):
        SentencePieceBPE(toks, scores, types).encode('é')

def test_bad_vocabularies_and_ids_raise():
    with pytest.raises(TokenizerError, match='3 tokens but scores of shape \\(2,\\)'):
        SentencePieceBPE(['a', 'b', 'c'], [0.0, 0.0])
    with pytest.raises(TokenizerError, match='1 duplicate'):
        SentencePieceBPE(['a', 'a'], [0.0, 0.0])
    tok = SentencePieceBPE(['a', '<s>'], [0.0, 0.0], [NORMAL, CONTROL])
    with pytest.raises(TokenizerError, match='token id 2 out of range'):
        tok.decode([0, 2])
    assert tok.decode([0, 1]) == 'a<s>' and tok.encode('a<s>', parse_special=True) == [0, 1]

class _File:
    def __init__(self, **md): self.metadata = {'tokenizer.ggml.' + k: v for k, v in md.items()}

def test_from_gguf_dispatch_and_errors():
    tok = tokenizer.from_gguf(_File(model='llama', tokens=['<unk>', '▁', 'a', '▁a'],
                                    scores=[0.0, -1.0, -2.0, -3.0], token_type=[2, 1, 1, 1],
                                    unknown_token_id=0))
    assert isinstance(tok, tokenizer.SPMTokenizer) and tok.add_space_prefix and tok.add_bos
    assert tok.encode('a') == [3] and tok.decode([3]) == 'a'         # llama.cpp's defaults
    bpe = tokenizer.from_gguf(_File(model='gpt2', tokens=['a', 'b', 'ab'], merges=['a b']))
    assert isinstance(bpe, tokenizer.BPETokenizer) and bpe.encode('ab') == [2]
    with pytest.raises(TokenizerError, match="'bert' is not supported"):
        tokenizer.from_gguf(_File(model='bert', tokens=['a']))
    with pytest.raises(TokenizerError, match="lacks 'tokenizer.ggml.scores'"):
        tokenizer.from_gguf(_File(model='llama', tokens=['a']))

# ---------- hostile vocabularies: long and nested special tokens, deep merge trees ----------
def test_long_control_token_needs_no_recursion():
    "A 2,000-character CONTROL token (once a RecursionError) is cut out like any other."
    toks = ['<unk>', 'x' * 2000, 'a', 'b', 'x']
    tok = SentencePieceBPE(toks, [0.0] * 5, [UNKNOWN, CONTROL, NORMAL, NORMAL, NORMAL], unk_id=0)
    assert tok.encode('a' + 'x' * 2000 + 'b', parse_special=True) == [2, 1, 3]
    assert tok.encode('a' + 'x' * 1999, parse_special=True) == [2] + [4] * 1999

def test_deeply_nested_special_tokens_are_refused():
    "A chain of prefixes deeper than SPECIAL_CAPS allows: a TokenizerError, not a RecursionError."
    from gradus.formats.spm import SPECIAL_CAPS
    k = SPECIAL_CAPS['max_nesting']
    ok = ['<' * i for i in range(1, k + 2)]                 # nests exactly max_nesting deep
    assert [m.group() for m in _alternation(ok).finditer('<' * (k + 3))] == ['<' * (k + 1), '<<']
    with pytest.raises(TokenizerError, match='nest 299 groups deep'):
        _alternation(['<' * i for i in range(1, 301)])
    assert _alternation(['', '']) is None                   # empty texts never match

def test_resegment_deep_merge_tree():
    "An unused piece made of a 3,000-deep chain of unused merges splits back without recursion."
    from gradus.formats.spm import _resegment
    n = 3000
    made_of = {'a' * i: ('a' * (i - 1), 'a') for i in range(2, n + 1)}
    assert _resegment('a' * n, made_of, set(made_of)) == ['a'] * n
    assert _resegment('a' * n, made_of, {'a' * n}) == ['a' * (n - 1), 'a']

@pytest.mark.parametrize('args, words', [
    ((['a', 7], [0.0, 0.0]), r'tokens\[1\] is int'),
    ((['a', 'b'], [0.0, 0.0], [1]), '2 tokens but 1 token_types'),
    ((['a', 'b'], [0.0, 0.0], [1, 7]), r'token_types\[1\] = 7'),
    ((['a', 'b'], [0.0, float('nan')]), 'score of token 1 is NaN'),
    ((['a', 'b'], ['x', 'y']), 'scores must be a list of numbers'),
    ((['a', 'b'], [0.0, 0.0], None, 2), 'bos_id 2 is out of range'),
    ((['a', 'b'], [0.0, 0.0], None, None, -1), 'eos_id -1 is out of range'),
    ((['a', 'b'], [0.0, 0.0], None, None, None, True), 'unk_id must be an integer'),
    (([], []), 'tokens is empty')])
def test_malformed_vocabulary_arguments_raise(args, words):
    with pytest.raises(TokenizerError, match=words): SentencePieceBPE(*args)
