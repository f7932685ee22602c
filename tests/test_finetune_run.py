"""`gradus finetune` (nbs/jobs/34a_finetune_run.ipynb): the exit status of each refusal, a whole
small run and its files (the adapter read back from both exports equals the checkpoint's), a
resumed run equal bit for bit to one run straight through, resume refusals, conversations
(JSONL) trained on their replies."""

import json
import numpy as np
import pytest

from gradus.core.pytree import tree_leaves
from gradus.formats import gguf
from gradus.jobs import cli, finetune as F
from gradus.learn import optim, random, train
from gradus.lm import adapters, chat, lora
from _models import find

SMOLLM2, needs_smollm2 = find(gguf.smollm2_path, 'SmolLM2')
pytestmark = needs_smollm2

SMALL = dict(steps=4, warmup=1, seq_len=16, batch_size=1, eval_interval=2, eval_windows=1,
             sample_len=4, rank=2, targets='q,v,down')


@pytest.fixture(scope='module')
def smol():
    return chat.load(SMOLLM2)


def _flags(**kw):
    return [w for k, v in kw.items() for w in ('--' + k.replace('_', '-'), str(v))]


@pytest.mark.parametrize('flags, status, words', [
    (['--rank', '0'], 2, 'rank must be an int >= 1'),
    (['--rank', '600'], 2, 'exceeds the width 576'),
    (['--targets', 'q,lm_head'], 2, "unknown target 'lm_head'"),
    (['--steps', '0'], 2, '--steps must be an int > 0'),
    (['--seq-len', '9000'], 2, 'exceeds the model\'s context'),
    (['--dropout', '1.0'], 2, 'dropout must be in'),
    (['--lr', 'nan'], 2, '--lr must be a finite number'),
    (['--data', 'absent.txt'], 1, 'absent.txt: no such file'),
    (['--data', 'absent.jsonl'], 1, 'absent.jsonl: no such file'),
])
def test_each_refusal_is_one_line_with_its_exit_status(flags, status, words, tmp_path, capsys,
                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(['finetune', '--no-progress', '--steps', '3', '--warmup', '1'] + flags) \
        == status
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / 'finetune-run').exists()           # refused before the folder


def test_data_too_short_and_out_a_file(tmp_path, capsys):
    (tmp_path / 'short.txt').write_text('To be, or not to be.')
    (tmp_path / 'file').write_text('x')
    assert cli.main(['finetune', '--data', str(tmp_path / 'short.txt'),
                     '--out', str(tmp_path / 'o')]) == 1
    assert 'shorter than one window' in capsys.readouterr().err
    assert cli.main(['finetune', '--out', str(tmp_path / 'file'), '--steps', '2',
                     '--warmup', '1']) == 1
    assert 'exists and is not a folder' in capsys.readouterr().err


def test_a_small_run_writes_its_files_and_both_exports_hold_its_adapters(tmp_path, capsys):
    out = tmp_path / 'run'
    assert cli.main(['finetune', '--no-progress', '--out', str(out)] + _flags(**SMALL)) == 0
    printed = capsys.readouterr().out
    assert '--- base model ---' in printed and '--- adapted ---' in printed
    assert all(str(out / n) in printed for n in F.FILES)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith('.')) == sorted(F.FILES)
    rows = [json.loads(line) for line in (out / 'metrics.jsonl').read_text().splitlines()]
    assert [r['step'] for r in rows] == [1, 2, 3, 4]
    assert [r['step'] for r in rows if 'val_loss' in r] == [2, 4]
    params, config = chat.load(SMOLLM2)[:2]
    lcfg = F.lora_config(F.FinetuneConfig(**SMALL))
    like = train.init_state(lora.init(random.key(0), params, lcfg),
                            optim.adamw(F.schedule(F.FinetuneConfig(**SMALL))), random.key(0))
    saved = train.load_checkpoint(out / 'ckpt.safetensors', like=like)
    assert saved.step == 4
    for source in (out / 'adapter.gguf', out):                 # llama.cpp's file, PEFT's folder
        back, cfg = adapters.load_adapter(source, params, config)
        assert cfg.rank == 2 and cfg.scale == lcfg.scale
        for i, la in enumerate(saved.params['layers']):
            for k, ab in la.items():
                assert np.array_equal(back['layers'][i][k]['a'], ab['a'])
                assert np.array_equal(back['layers'][i][k]['b'], ab['b'])
    assert any(np.abs(ab['b']).max() > 0 for la in saved.params['layers'] for ab in la.values())


def test_an_interrupted_run_resumes_bit_for_bit(smol, tmp_path, monkeypatch):
    """Ctrl-C after step 2 of 4 (raised from train.fit's callback), then --resume: the adapters
    and the losses of every step equal those of a run straight through."""
    quiet = dict(progress=False, log=lambda *a: None, model=smol)
    whole = F.FinetuneConfig(**SMALL, out=str(tmp_path / 'whole'))
    s_whole, r_whole, _ = F.run(whole, **quiet)
    cut = whole._replace(out=str(tmp_path / 'cut'))
    real_fit = F.train.fit

    def interrupted_fit(*args, callback=None, **kw):
        def cb(rec):
            callback(rec)
            if rec['step'] == 2: raise KeyboardInterrupt
        return real_fit(*args, callback=cb, **kw)
    monkeypatch.setattr(F.train, 'fit', interrupted_fit)
    with pytest.raises(KeyboardInterrupt):
        F.run(cut, **quiet)
    monkeypatch.setattr(F.train, 'fit', real_fit)
    s_cut, r_cut, _ = F.run(cut, resume=True, **quiet)
    assert s_cut.step == 4
    for a, b in zip(tree_leaves(s_whole.params), tree_leaves(s_cut.params)):
        assert np.array_equal(a, b)
    strip = lambda rs: [{k: v for k, v in r.items() if k != 'ms'} for r in rs]
    assert strip(r_cut) == strip(r_whole)


def test_resume_refuses_other_data(smol, tmp_path):
    quiet = dict(progress=False, log=lambda *a: None, model=smol)
    text = tmp_path / 'a.txt'
    text.write_text('Shall I compare thee to a summer\'s day? ' * 40)
    cfg = F.FinetuneConfig(**{**SMALL, 'steps': 2}, data=str(text), out=str(tmp_path / 'r'))
    F.run(cfg, **quiet)
    text.write_text('Thou art more lovely and more temperate. ' * 40)
    with pytest.raises(train.CheckpointError, match='another data'):
        F.run(cfg, resume=True, **quiet)


def test_conversations_train_on_their_replies(smol, tmp_path):
    pairs = [{'prompt': f'Spell {w}.', 'response': ' '.join(w.upper())}
             for w in ('cat', 'dog', 'owl', 'elk', 'yak', 'ant', 'bee', 'cow', 'eel', 'fox')]
    p = tmp_path / 'spell.jsonl'
    p.write_text(''.join(json.dumps(r) + '\n' for r in pairs))
    cfg = F.FinetuneConfig(**{**SMALL, 'seq_len': 64, 'batch_size': 2}, data=str(p),
                           out=str(tmp_path / 'c'))
    data = F.load_data(cfg, smol.tokenizer)
    assert data.kind == 'chat' and len(data.train[0]) == 9 and len(data.val_x) == 1
    kept = data.val_y[data.val_y != F.finetune.IGNORE]
    assert smol.tokenizer.decode([int(i) for i in kept]) == 'F O X<|im_end|>\n'
    state, records, _ = F.run(cfg, progress=False, log=lambda *a: None, model=smol)
    assert [r['step'] for r in records if 'val_loss' in r] == [2, 4]
    one = p.with_name('one.jsonl'); one.write_text(json.dumps(pairs[0]) + '\n')
    with pytest.raises(F.DataError, match='need at least 2'):
        F.load_data(cfg._replace(data=str(one)), smol.tokenizer)


def _generated(smol, argv):
    import io
    args = cli.build_parser().parse_args(['generate'] + argv)
    out, err = io.StringIO(), io.StringIO()
    assert chat.cli(args, out=out, err=err, model=smol) == 0, err.getvalue()
    return out.getvalue().rsplit('\n', 2)[0]                       # the text, without the rates


def test_generate_with_lora_runs_the_adapted_model(smol, tmp_path):
    """`gradus generate --lora` with the adapter as llama.cpp's GGUF and as a PEFT folder gives the
    same greedy text, which is the adapted model's (lora.attach, models.forward) and not the
    base's; an adapter for another architecture is refused naming the file."""
    params, config = smol.params, smol.config
    lcfg = lora.LoraConfig(rank=4, alpha=8.0, targets=('q', 'v', 'up'))
    ad = lora.init(random.key(5), params, lcfg)
    g = np.random.default_rng(5)
    for la in ad['layers']:
        for ab in la.values(): ab['b'] = (0.3 * g.standard_normal(ab['b'].shape)).astype(np.float32)
    adapters.save_gguf_adapter(tmp_path / 'a.gguf', ad, lcfg, config)
    adapters.save_peft(tmp_path / 'peft', ad, lcfg, config)
    flags = ['--temperature', '0', '--max-new-tokens', '10', 'The king said']
    via_gguf = _generated(smol, ['--lora', str(tmp_path / 'a.gguf')] + flags)
    via_peft = _generated(smol, ['--lora', str(tmp_path / 'peft')] + flags)
    base = _generated(smol, flags)
    attached = chat.with_adapter(smol, tmp_path / 'a.gguf')
    assert via_gguf == via_peft == _generated(attached, flags) and via_gguf != base
    wide = tmp_path / 'wide.gguf'                              # an adapter for a wider model
    adapters.save_gguf_adapter(wide, ad, lcfg, config._replace(architecture='qwen2'))
    args = cli.build_parser().parse_args(['generate', '--lora', str(wide)] + flags)
    with pytest.raises(F.FormatError, match='wide.gguf'):
        chat.cli(args, model=smol)


MEASURE = r"""
import argparse, json, sys
from gradus.jobs import finetune as F
def peak():   # this process's peak resident set, VmHWM, which exec starts afresh
    with open('/proc/self/status') as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith('VmHWM:'))
p = argparse.ArgumentParser(); F.add_arguments(p)
args = p.parse_args(sys.argv[1:])
cfg = F.FinetuneConfig(**{k: getattr(args, k) for k in F.FinetuneConfig._fields})
base, logs = peak(), []                 # the interpreter with gradus imported: the baseline
F.run(cfg, progress=False, log=logs.append)
print(json.dumps({'baseline': base, 'peak': peak(), 'log': logs}))
"""


@pytest.mark.parametrize('seq_len', [64, 256])
def test_memory_estimate_beside_the_measured_peak(seq_len, tmp_path):
    """A whole run in a fresh process (load, evaluations, a training step, samples, exports): its
    peak resident set less the interpreter's is at most the estimate the run states, and the
    estimate at most twice it."""
    import os, re, subprocess, sys
    if not os.path.exists('/proc/self/status'): pytest.skip('needs Linux /proc')
    r = subprocess.run([sys.executable, '-c', MEASURE, '--steps', '1', '--warmup', '0',
                        '--seq-len', str(seq_len), '--batch-size', '1', '--eval-interval', '1',
                        '--eval-windows', '1', '--sample-len', '4', '--out', str(tmp_path / 'o')],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.splitlines()[-1])
    measured = m['peak'] - m['baseline']
    stated = int(re.search(r'memory: about ([\d,]+) MiB', m['log'][0]).group(1).replace(',', ''))
    print(f"seq_len {seq_len}: estimate {stated} MiB, measured {measured / 2**20:.0f} MiB")
    assert measured <= stated * 2**20 <= 2 * measured, (stated, measured / 2**20)


def test_a_peft_config_that_lies_is_refused(smol, tmp_path):
    """adapter_config.json that is not an object, or whose target_modules are not the matrices the
    tensors adapt (a list of names, or PEFT's regular expression), is a FormatError naming it."""
    lcfg = lora.LoraConfig(rank=2, targets=('q', 'v'))
    ad = lora.init(random.key(1), smol.params, lcfg)
    adapters.save_peft(tmp_path / 'p', ad, lcfg, smol.config)
    cfg_path = tmp_path / 'p' / 'adapter_config.json'
    good = json.loads(cfg_path.read_text())
    assert sorted(good['target_modules']) == ['q_proj', 'v_proj']
    adapters.load_adapter(tmp_path / 'p', smol.params, smol.config)
    for bad, words in [([1], 'not an object'),
                       ({**good, 'target_modules': ['q_proj']}, 'target_modules'),
                       ({**good, 'target_modules': '.*k_proj'}, 'target_modules')]:
        cfg_path.write_text(json.dumps(bad))
        with pytest.raises(F.FormatError, match=words):
            adapters.load_adapter(tmp_path / 'p', smol.params, smol.config)
    cfg_path.write_text(json.dumps({**good, 'target_modules': r'.*\.(q|v)_proj'}))
    adapters.load_adapter(tmp_path / 'p', smol.params, smol.config)


def test_top_k_is_checked_before_anything_is_written(tmp_path, capsys):
    assert cli.main(['finetune', '--top-k', '-1', '--out', str(tmp_path / 'o')]) == 2
    assert '--top-k must be an int >= 0' in capsys.readouterr().err
    assert not (tmp_path / 'o').exists()
