"""Attacks on the run folder of `gradus shakespeare` (issue 25 item 6): SIGKILLs at chosen points of
a run, full disks, a second run in the same folder, tampered checkpoints, logs and configurations,
stale temporaries. Each attack ends in a typed error that names the file or setting, in one line
from the command, or in a folder whose resume is the uninterrupted run, bit for bit.

Bounded by work: a GPT of one block of width 16 trained 4 steps on a 21k-character text, one
thread, the loss plot replaced by one small atomic write (the attacks are on the folder, not on
matplotlib); each kill is a child forked from this warmed-up process (no import, no compile),
that SIGKILLs itself at the k-th call of `os.replace`, `os.write` or `os.unlink` on the folder,
so every point is reached deterministically, whatever the machine's speed."""
import argparse, contextlib, errno, io, json, os, signal, traceback
from pathlib import Path
import numpy as np
import pytest
from gradus.core import kernels
from gradus.errors import CheckpointError, DataError
from gradus.formats.safetensors import (atomic_write, load_safetensors, save_safetensors,
                                        stale_temporaries)
from gradus.jobs import shakespeare as S
from gradus.learn import train

pytestmark = pytest.mark.skipif(not hasattr(os, 'fork'), reason='the kills fork (POSIX only)')

TINY = dict(iters=4, eval_interval=2, eval_iters=1, batch_size=4, block_size=16, n_layer=1,
            n_head=2, n_embd=16, warmup=1, sample_len=5)
FLAGS = ['--iters', '4', '--eval-interval', '2', '--eval-iters', '1', '--batch-size', '4',
         '--block-size', '16', '--n-layer', '1', '--n-head', '2', '--n-embd', '16', '--warmup',
         '1', '--sample-len', '5', '--no-progress']
quiet = lambda *a: None


@pytest.fixture(scope='module', autouse=True)
def one_thread_and_a_cheap_plot():
    """One thread (a resume equals the straight run bit for bit at the same shard count) and a loss
    plot that is one small atomic write instead of matplotlib's half second."""
    before = kernels.threads()
    kernels.set_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(S, 'plot_losses',
                   lambda records, path: S._write_atomic(path, f"{len(records)} steps\n"))
        yield
    kernels.set_threads(before)


def _text(seed):
    words = ('to be or not that is the question whether tis nobler in the mind to suffer the '
             'slings and arrows of outrageous fortune').split()
    rng = np.random.default_rng(seed)
    return '\n'.join(' '.join(rng.choice(words, 10)) for _ in range(400)) + '\n'


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    p = tmp_path_factory.mktemp('data') / 'words.txt'
    p.write_text(_text(0), encoding='utf-8')
    return p


def _cfg(corpus, out, **kw):
    return S.RunConfig(data=str(corpus), out=str(out), **{**TINY, **kw})


def _tensors(out):
    return load_safetensors(Path(out) / 'ckpt.safetensors')


def _rows(out, warn=None):
    return [{k: v for k, v in r.items() if k != 'ms'} for r in S.read_metrics(out, warn=warn)]


@pytest.fixture(scope='module')
def reference(corpus, tmp_path_factory):
    "The run never interrupted: its checkpoint's tensors and its log (without the timings)."
    out = tmp_path_factory.mktemp('reference') / 'run'
    S.run(_cfg(corpus, out), progress=False, log=quiet)
    return _tensors(out), _rows(out), out


def _same_as(reference, out):
    "The folder `out` holds the reference run: the same tensors, bit for bit, the same log."
    tensors, rows, _ = reference
    got = _tensors(out)
    assert got.keys() == tensors.keys()
    for k in got: assert got[k].dtype == tensors[k].dtype and np.array_equal(got[k], tensors[k]), k
    assert _rows(out) == rows
    assert not [p for n in S.RUN_FILES for p in stale_temporaries(Path(out) / n)]


def _cli(*args):
    "`gradus shakespeare ARGS` in this process: (exit status, stderr)."
    p = argparse.ArgumentParser(); S.add_arguments(p)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = S.cli(p.parse_args(list(args)))
    return status, err.getvalue()


# --- kills at chosen points -----------------------------------------------------------------

def _in(out, path):
    try: return Path(os.fsdecode(path)).parent.resolve() == Path(out).resolve()
    except (TypeError, ValueError): return False


def _arm(out, point, calls):
    """Wrap `os.replace`, `os.write` and `os.unlink` so that each call on the run folder `out` is
    appended to `calls` as `(op, file name)`, and the `k`-th call of `op` of `point = (op, k, when)`
    SIGKILLs this process `'before'` it, `'after'` it, or `'mid'` a write (half its bytes out).
    `point=None`: a census, nothing killed."""
    real = {'replace': os.replace, 'write': os.write, 'unlink': os.unlink}
    def kill(): os.kill(os.getpid(), signal.SIGKILL)
    def wrapped(op):
        def call(*a, **kw):
            if op == 'write': mine, name = a[1][:8] == b'{"step":', 'metrics.jsonl'
            else:
                target = a[1] if op == 'replace' else a[0]
                mine, name = _in(out, target), Path(os.fsdecode(target)).name
            if not mine: return real[op](*a, **kw)
            calls.append((op, name))
            here = point is not None and point[:2] == (op, sum(c[0] == op for c in calls))
            if here and point[2] == 'before': kill()
            if here and point[2] == 'mid': real['write'](a[0], a[1][:len(a[1]) // 2]); kill()
            try: return real[op](*a, **kw)
            finally:
                if here and point[2] == 'after': kill()   # even when the call raised
        return call
    for op in real: setattr(os, op, wrapped(op))
    return real


def _killed(cfg, point, resume=False):
    """Run `cfg` in a forked child that SIGKILLs itself at `point` (`_arm`); returns its exit
    status (-9 when the point was reached). The child never comes back into pytest."""
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            _arm(cfg.out, point, [])
            S.run(cfg, resume=resume, progress=False, log=quiet)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _agrees_after_kill(out):
    """What any kill must leave: a checkpoint that loads whole (or none) and a log that reads and
    holds every step up to the checkpoint's (never behind it). Returns the checkpoint's step."""
    ckpt = Path(out) / 'ckpt.safetensors'
    step = train.load_checkpoint(ckpt).step if ckpt.exists() else 0
    steps = [r['step'] for r in S.read_metrics(out, warn=quiet)]
    assert steps[:step] == list(range(1, step + 1)), (step, steps)
    return step


CENSUS = [('unlink', '.gradus-write-test'), ('unlink', 'ckpt.safetensors'), ('unlink', 'loss.png'),
          ('unlink', 'sample.txt'), ('replace', 'config.json'), ('replace', 'metrics.jsonl'),
          ('write', 'metrics.jsonl'), ('write', 'metrics.jsonl'), ('replace', 'ckpt.safetensors'),
          ('write', 'metrics.jsonl'), ('write', 'metrics.jsonl'), ('replace', 'ckpt.safetensors'),
          ('replace', 'loss.png')]


def test_the_kill_points_are_the_writes_of_a_run(corpus, tmp_path, monkeypatch):
    """The census of the writes a fresh run makes in its folder, in order: the points the sweep
    below kills at. (Each log line is written before the checkpoint of its step.)"""
    calls = []
    real = _arm(tmp_path / 'run', None, calls)
    try: S.run(_cfg(corpus, tmp_path / 'run'), progress=False, log=quiet)
    finally:
        for op, f in real.items(): setattr(os, op, f)
    probe = lambda n: '.gradus-write-test' if n.startswith('.gradus-write-test.') else n
    assert [(op, probe(name)) for op, name in calls] == CENSUS


POINTS = ([('unlink', k, w) for k in range(1, 5) for w in ('before', 'after')]
          + [('replace', k, w) for k in range(1, 6) for w in ('before', 'after')]
          + [('write', k, w) for k in range(1, 5) for w in ('mid', 'after')])


@pytest.mark.parametrize('point', POINTS, ids=lambda p: '-'.join(map(str, p)))
def test_a_run_killed_anywhere_resumes_to_the_uninterrupted_run(corpus, tmp_path, reference,
                                                                  point):
    """SIGKILL at each write of a fresh run (before or after each rename and removal, in the middle
    of each log line and after it): the folder agrees with itself (the log is never behind the
    checkpoint, which loads whole), and `--resume` removes the stale temporaries, drops the cut
    line and ends in the uninterrupted run, bit for bit."""
    cfg = _cfg(corpus, tmp_path / 'run')
    assert _killed(cfg, point) == -signal.SIGKILL
    _agrees_after_kill(cfg.out)
    S.run(cfg, resume=True, progress=False, log=quiet)
    _same_as(reference, cfg.out)


@pytest.mark.parametrize('second', [('replace', 1, 'before'), ('replace', 2, 'before'),
                                    ('replace', 2, 'after'), ('write', 1, 'mid'),
                                    ('replace', 3, 'before'), ('replace', 3, 'after')],
                         ids=lambda p: '-'.join(map(str, p)))
def test_a_resume_killed_again_resumes_to_the_uninterrupted_run(corpus, tmp_path, reference,
                                                                 second):
    "Killed mid-line after the first checkpoint, then the resume itself killed at `second`."
    cfg = _cfg(corpus, tmp_path / 'run')
    assert _killed(cfg, ('write', 3, 'mid')) == -signal.SIGKILL
    assert _agrees_after_kill(cfg.out) == 2
    assert _killed(cfg, second, resume=True) == -signal.SIGKILL
    assert _agrees_after_kill(cfg.out) >= 2
    S.run(cfg, resume=True, progress=False, log=quiet)
    _same_as(reference, cfg.out)


@pytest.mark.parametrize('point', [('unlink', 2, 'before'), ('unlink', 2, 'after'),
                                   ('replace', 1, 'after'), ('write', 1, 'mid'),
                                   ('replace', 3, 'before')], ids=lambda p: '-'.join(map(str, p)))
def test_a_fresh_run_over_an_old_one_killed_never_mixes_the_two(corpus, tmp_path, reference,
                                                                point):
    """A folder holding a finished run of another seed, a fresh run started over it and killed:
    `--resume` with the new settings never continues the old checkpoint under the new log. Either
    the old run is still whole (refused, naming --seed) or the new one resumes to the reference."""
    cfg = _cfg(corpus, tmp_path / 'run')
    S.run(cfg._replace(seed=7), progress=False, log=quiet)
    assert _killed(cfg, point) == -signal.SIGKILL
    _agrees_after_kill(cfg.out)
    try: S.run(cfg, resume=True, progress=False, log=quiet)
    except CheckpointError as e:
        assert '--seed 1337' in str(e) and point == ('unlink', 2, 'before'), e
        assert json.loads((tmp_path / 'run' / 'config.json').read_text())['run']['seed'] == 7
        S.run(cfg, progress=False, log=quiet)
    _same_as(reference, cfg.out)


# --- full disks -------------------------------------------------------------------------------

def _disk_full_at_line(monkeypatch, k, truncate_fails=False):
    """`os.write` that, at the `k`-th line of the log, writes half the line and raises ENOSPC (and,
    with `truncate_fails`, an `os.ftruncate` that cannot cut it back)."""
    real, seen = os.write, [0]
    def write(fd, data):
        if bytes(data[:8]) == b'{"step":':
            seen[0] += 1
            if seen[0] == k:
                real(fd, data[:len(data) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)
    monkeypatch.setattr(os, 'write', write)
    if truncate_fails:                  # the log's cut back to its last line (not the lock's to 0)
        real_truncate = os.ftruncate
        def ftruncate(fd, n):
            if n: raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real_truncate(fd, n)
        monkeypatch.setattr(os, 'ftruncate', ftruncate)


@pytest.mark.parametrize('k', [1, 3, 4])
def test_a_full_disk_mid_line_leaves_no_half_line(corpus, tmp_path, reference, monkeypatch, k):
    """ENOSPC in the middle of the k-th log line: the run stops with an `OSError` naming
    metrics.jsonl, the file is cut back to its last whole line, and the resume (disk freed) is the
    uninterrupted run; through the command, one line naming --out and the file."""
    cfg = _cfg(corpus, tmp_path / 'run')
    _disk_full_at_line(monkeypatch, k)
    with pytest.raises(OSError) as e: S.run(cfg, progress=False, log=quiet)
    assert e.value.errno == errno.ENOSPC and e.value.filename.endswith('metrics.jsonl')
    raw = (tmp_path / 'run' / 'metrics.jsonl').read_bytes()
    assert raw.count(b'\n') == k - 1 and (not raw or raw.endswith(b'\n'))
    _agrees_after_kill(cfg.out)
    monkeypatch.undo()
    notes = []
    S.run(cfg, resume=True, progress=False, log=notes.append)
    assert not any('dropped' in n for n in notes), notes
    _same_as(reference, cfg.out)
    _disk_full_at_line(monkeypatch, k)
    status, err = _cli('--data', str(corpus), '--out', str(tmp_path / 'cli'), *FLAGS)
    assert status == 1 and err == (f"gradus shakespeare: --out {tmp_path / 'cli'}: cannot write "
                                   f"metrics.jsonl (No space left on device)\n"), err


def test_a_line_cut_for_good_is_dropped_with_one_note(corpus, tmp_path, reference, monkeypatch):
    "ENOSPC mid-line and the cut cannot be undone: the next resume drops the half line, saying so."
    cfg = _cfg(corpus, tmp_path / 'run')
    _disk_full_at_line(monkeypatch, 3, truncate_fails=True)
    with pytest.raises(OSError): S.run(cfg, progress=False, log=quiet)
    monkeypatch.undo()
    assert not (tmp_path / 'run' / 'metrics.jsonl').read_bytes().endswith(b'\n')
    notes = []
    S.run(cfg, resume=True, progress=False, log=notes.append)
    dropped = [n for n in notes if 'dropped' in n]
    assert len(dropped) == 1 and 'line 3' in dropped[0] and 'metrics.jsonl' in dropped[0], notes
    _same_as(reference, cfg.out)


FSYNCS = ['config.json', 'folder', 'metrics.jsonl', 'folder', 'metrics.jsonl (log)',
          'ckpt.safetensors', 'folder', 'metrics.jsonl (log)', 'ckpt.safetensors', 'folder',
          'loss.png', 'folder']


@pytest.mark.parametrize('k', [1, 3, 5, 6, 7, 9])
def test_a_full_disk_at_an_fsync(corpus, tmp_path, reference, monkeypatch, k):
    """ENOSPC (or EIO) from the k-th fsync of a run (`FSYNCS`: each atomic write's temporary and
    folder, the log before each checkpoint): an `OSError` naming the file meant, no temporary left,
    the folder in agreement, and the resume is the uninterrupted run."""
    cfg = _cfg(corpus, tmp_path / 'run')
    real, seen = os.fsync, [0]
    def fsync(fd):
        seen[0] += 1
        if seen[0] == k: raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)
    monkeypatch.setattr(os, 'fsync', fsync)
    with pytest.raises(OSError) as e: S.run(cfg, progress=False, log=quiet)
    monkeypatch.undo()
    meant = FSYNCS[k - 1].split(' ')[0]
    name = Path(e.value.filename).name
    assert (name == 'run' if meant == 'folder' else meant in name), (name, meant)
    assert not [p for n in S.RUN_FILES for p in stale_temporaries(tmp_path / 'run' / n)]
    _agrees_after_kill(cfg.out)
    S.run(cfg, resume=True, progress=False, log=quiet)
    _same_as(reference, cfg.out)


def test_the_log_is_durable_before_each_checkpoint(corpus, tmp_path, monkeypatch):
    """The order of a run's fsyncs and renames: each checkpoint is renamed only after the log was
    fsynced following its last line, and each atomic write fsyncs its file before the rename and
    the folder after it."""
    events, real_fsync, real_replace, real_write = [], os.fsync, os.replace, os.write
    def fsync(fd):
        st = os.fstat(fd)
        events.append(('fsync', 'folder' if os.path.isdir(f'/proc/self/fd/{fd}') else st.st_ino))
        return real_fsync(fd)
    def replace(a, b):
        events.append(('replace', os.stat(a).st_ino, Path(b).name)); return real_replace(a, b)
    def write(fd, data):
        if bytes(data[:8]) == b'{"step":': events.append(('line', os.fstat(fd).st_ino))
        return real_write(fd, data)
    monkeypatch.setattr(os, 'fsync', fsync); monkeypatch.setattr(os, 'replace', replace)
    monkeypatch.setattr(os, 'write', write)
    if not os.path.isdir('/proc/self/fd'): pytest.skip('needs /proc to tell a folder from a file')
    S.run(_cfg(corpus, tmp_path / 'run'), progress=False, log=quiet)
    monkeypatch.undo()
    log_ino = next(e[1] for e in events if e[0] == 'line')
    for i, e in enumerate(events):
        if e[0] != 'replace': continue
        assert events[i - 1] == ('fsync', e[1]) and events[i + 1] == ('fsync', 'folder'), e
        if e[2] == 'ckpt.safetensors':
            last_line = max(j for j in range(i) if events[j][0] == 'line')
            assert ('fsync', log_ino) in events[last_line:i], events[last_line:i]


def _limited_cli(limit, *args):
    """`gradus shakespeare ARGS` in a forked child whose files cannot grow past `limit` bytes
    (RLIMIT_FSIZE: the kernel's short write, then EFBIG, as a full disk would): (status, stderr)."""
    import resource
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.close(r)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # the error, not the signal's kill
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
            code, err = _cli(*args)
            os.write(w, err.encode())
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, 'rb') as f: err = f.read().decode()
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), err


def test_a_file_size_limit_from_the_kernel(corpus, tmp_path, reference):
    """Writes the kernel refuses (RLIMIT_FSIZE) below the size of config.json, and between it and
    the checkpoint's: exit status 1, one line naming --out and the file, no temporary left; the
    resume, without the limit, is the uninterrupted run."""
    config = (reference[2] / 'config.json').stat().st_size
    ckpt = (reference[2] / 'ckpt.safetensors').stat().st_size
    assert 2 * config < ckpt
    for limit, name in ((config // 2, 'config.json'), ((config + ckpt) // 2, 'ckpt.safetensors')):
        out = tmp_path / f'run{limit}'
        status, err = _limited_cli(limit, '--data', str(corpus), '--out', str(out), *FLAGS)
        assert status == 1 and err == (f"gradus shakespeare: --out {out}: cannot write {name} "
                                       f"(File too large)\n"), (limit, err)
        assert not [p for n in S.RUN_FILES for p in stale_temporaries(out / n)]
        _agrees_after_kill(out)
        S.run(_cfg(corpus, out), resume=True, progress=False, log=quiet)
        _same_as(reference, out)


# --- one run at a time ------------------------------------------------------------------------

def test_a_second_run_is_refused_while_the_first_holds_the_folder(corpus, tmp_path, reference):
    """A run holding its folder (paused in its log at step 2): a second run there, resumed or
    fresh, same settings or others, is refused naming the folder and the holder's process, and
    changes nothing; once the holder is SIGKILLed its lock is gone and the resume finishes."""
    cfg = _cfg(corpus, tmp_path / 'run')
    ready, go = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.close(ready[0])
            real = S.MetricsLog.__call__
            def pausing(self, rec):
                real(self, rec)
                if rec['step'] == 2: os.write(ready[1], b'!'); os.read(go[0], 1)
            S.MetricsLog.__call__ = pausing
            S.run(cfg, progress=False, log=quiet)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(ready[1])                     # a child that dies unready ends the read, not hangs it
    try:
        assert os.read(ready[0], 1) == b'!'
        before = {p.name: p.read_bytes() for p in (tmp_path / 'run').iterdir() if p.is_file()}
        for other in (cfg, cfg._replace(lr=0.01, seed=3)):
            for resume in (True, False):
                with pytest.raises(DataError, match=rf"another run \(process {pid}\) is using"):
                    S.run(other, resume=resume, progress=False, log=quiet)
        status, err = _cli('--data', str(corpus), '--out', cfg.out, *FLAGS, '--resume')
        assert status == 1 and err.count('\n') == 1 and f"--out {cfg.out}: another run" in err
        after = {p.name: p.read_bytes() for p in (tmp_path / 'run').iterdir() if p.is_file()}
        assert after == before
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        for fd in (ready[0], *go): os.close(fd)
    S.run(cfg, resume=True, progress=False, log=quiet)
    _same_as(reference, cfg.out)


# --- a resume continues only the folder's own run ------------------------------------------------

MUST_MATCH = [('lr', 2e-3), ('min_lr', 0.0), ('warmup', 2), ('beta1', 0.8), ('beta2', 0.95),
              ('weight_decay', 0.0), ('grad_clip', 0.5), ('seed', 1), ('batch_size', 2),
              ('iters', 6), ('lr_decay_iters', 8)]


@pytest.mark.parametrize('name,value', MUST_MATCH, ids=[n for n, _ in MUST_MATCH])
def test_a_resume_with_other_settings_is_refused_naming_them(corpus, tmp_path, name, value):
    """Settings that change the training (not the model, which is refused already): refused,
    naming the flag and both values; the folder is left as it was. A longer --iters moves the end
    of the learning rate's decay, and is refused unless --lr-decay-iters keeps it."""
    cfg = _cfg(corpus, tmp_path / 'run', iters=2)
    S.run(cfg, progress=False, log=quiet)
    before = {p.name: p.read_bytes() for p in (tmp_path / 'run').iterdir()}
    with pytest.raises(CheckpointError) as e:
        S.run(cfg._replace(**{name: value}), resume=True, progress=False, log=quiet)
    said = str(e.value)
    if name in ('iters', 'lr_decay_iters'):
        assert f"decay would end at step {value}, the run's ends at 2" in said, said
    else:
        assert f"--{name.replace('_', '-')} {value} (the run's: {getattr(cfg, name)!r})" in said
    assert {p.name: p.read_bytes() for p in (tmp_path / 'run').iterdir()} == before
    if name in ('beta1', 'beta2'): return          # settings of the API, not flags
    status, err = _cli('--data', str(corpus), '--out', cfg.out, *FLAGS[2:], '--iters', '2',
                       f"--{name.replace('_', '-')}", str(value), '--resume')
    assert status == 1 and err.count('\n') == 1 and 'Traceback' not in err, err


def test_a_resume_may_change_what_does_not_change_the_training(corpus, tmp_path, reference):
    """Where the run lives (a copy of the text elsewhere), how long it goes on (with the decay's
    end kept), how it evaluates and samples: the resume proceeds, to the uninterrupted run."""
    cfg = _cfg(corpus, tmp_path / 'run', iters=2, lr_decay_iters=4)
    S.run(cfg, progress=False, log=quiet)
    copy = tmp_path / 'copy.txt'
    copy.write_bytes(Path(corpus).read_bytes())
    S.run(cfg._replace(data=str(copy), iters=4, sample_len=9, temperature=0.5, top_k=3),
          resume=True, progress=False, log=quiet)
    _same_as(reference, cfg.out)


@pytest.mark.parametrize('case', ['other text', 'other model'])
def test_a_resume_on_another_text_or_model_is_refused(corpus, tmp_path, case):
    cfg = _cfg(corpus, tmp_path / 'run', iters=2)
    S.run(cfg, progress=False, log=quiet)
    if case == 'other text':            # the same characters in another order: vocabulary equal
        other = tmp_path / 'other.txt'
        other.write_text(_text(1), encoding='utf-8')
        cfg, match = cfg._replace(data=str(other)), 'another text'
    else: cfg, match = cfg._replace(n_embd=32), 'model'
    with pytest.raises(CheckpointError, match=match):
        S.run(cfg._replace(iters=2), resume=True, progress=False, log=quiet)


# --- tampered files ---------------------------------------------------------------------------

def _finished(corpus, tmp_path, **kw):
    cfg = _cfg(corpus, tmp_path / 'run', **kw)
    S.run(cfg, progress=False, log=quiet)
    return cfg, tmp_path / 'run'


CKPT_LIES = {
    'step -5': lambda f, m: ({**f, 'step': np.int64(-5)}, m),
    'step float': lambda f, m: ({**f, 'step': np.float64(2.0)}, m),
    'step past the optimizer': lambda f, m: ({**f, 'step': np.int64(1)}, m),
    'step and optimizer 10**15': lambda f, m: ({**f, 'step': np.int64(10**15),
                                                'opt_state.step': np.int64(10**15)},
                                               {**m, 'step': str(10**15)}),
    'header step': lambda f, m: (f, {**m, 'step': '9'}),
    'nan parameter': lambda f, m: ({**f, 'params.wte': f['params.wte'] * np.nan}, m),
    'inf moment': lambda f, m: ({**f, 'opt_state.nu.wte': f['opt_state.nu.wte'] + np.inf}, m),
    'key shape': lambda f, m: ({**f, 'key': np.zeros(3, np.uint64)}, m),
    'missing tensor': lambda f, m: ({k: v for k, v in f.items() if k != 'params.wte'}, m),
}
CKPT_BYTES = {'empty': b'', 'random': bytes(range(256)) * 8, 'truncated': None}


@pytest.fixture(autouse=True)
def no_hang():
    "A read that would wait for ever (a FIFO) fails the test after 60 s instead of hanging it."
    def hung(*a): raise TimeoutError('the run waited for ever')
    before = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, before)


@pytest.mark.parametrize('case', list(CKPT_LIES) + list(CKPT_BYTES) + ['a folder', 'a FIFO'])
def test_a_tampered_checkpoint_is_refused_in_one_line(corpus, tmp_path, case):
    """A checkpoint that lies (its step, its values, its tensors) or is not one: `--resume` exits
    1 with one line naming the checkpoint, no traceback, and leaves the folder as it was."""
    cfg, out = _finished(corpus, tmp_path, iters=2)
    ckpt = out / 'ckpt.safetensors'
    if case in CKPT_LIES:
        save_safetensors(ckpt, *CKPT_LIES[case](*load_safetensors(ckpt, with_metadata=True)))
    elif case == 'truncated': ckpt.write_bytes(ckpt.read_bytes()[:-100])
    elif case == 'a folder': ckpt.unlink(); ckpt.mkdir()
    elif case == 'a FIFO': ckpt.unlink(); os.mkfifo(ckpt)
    else: ckpt.write_bytes(CKPT_BYTES[case])
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    status, err = _cli('--data', str(corpus), '--out', str(out), *FLAGS[2:], '--iters', '2',
                       '--resume')
    assert status == 1 and err.count('\n') == 1 and 'Traceback' not in err, err
    assert str(ckpt) in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


LOG_DAMAGE = {   # what is done to the two lines of a finished 2-step log; the steps that survive
    'a half line at the end': (lambda a, b: a + b + b'{"step": 3, "train_lo', [1, 2]),
    'the last line cut': (lambda a, b: a + b[:-9], [1]),
    'garbage between': (lambda a, b: a + b'\x00\xff\xfe garbage\n' + b, [1, 2]),
    'not UTF-8': (lambda a, b: a + b'{"step": 2, "train_loss": "\xff"}\n' + b, [1, 2]),
    'a JSON array': (lambda a, b: b'[1, 2]\n' + a + b, [1, 2]),
    'a string step': (lambda a, b: a + b.replace(b'"step": 2', b'"step": "2"'), [1]),
    'a bool step': (lambda a, b: a.replace(b'"step": 1', b'"step": true') + b, [2]),
    'a step 0': (lambda a, b: b'{"step": 0, "train_loss": 1.0, "lr": 0.1}\n' + a + b, [1, 2]),
    'no loss': (lambda a, b: a + b'{"step": 2}\n' + b, [1, 2]),
    'an eval without its pair': (lambda a, b: a + b.replace(b'"train_loss_eval"', b'"x"'), [1]),
    'a 5000-digit number': (lambda a, b: a + b'{"step": ' + b'9' * 5000 + b'}\n' + b, [1, 2]),
    'nested 100000 deep': (lambda a, b: a + b'[' * 100_000 + b'\n' + b, [1, 2]),
    'a duplicate': (lambda a, b: a + b + b, [1, 2]),
    'out of order': (lambda a, b: b + a, [2]),
    'CRLF line ends': (lambda a, b: a.replace(b'\n', b'\r\n') + b, [1, 2]),
    'a line of a MiB': (lambda a, b: a + b'{"step": 2, "x": "' + b'a' * 2**20 + b'"}\n' + b,
                        [1, 2]),
    'a sparse 256 MiB': ('sparse', [1, 2]),
    'a FIFO': ('fifo', []),
    'empty': (lambda a, b: b'', []),
    'missing': (None, []),
}


@pytest.mark.parametrize('case', list(LOG_DAMAGE))
def test_a_damaged_log_is_recovered_line_by_line(corpus, tmp_path, reference, case):
    """A 2-step run's metrics.jsonl damaged (cut, garbage, lines that are JSON but not records,
    lines that would exhaust the parser, duplicates), then resumed to 4 steps: no traceback; the
    lines that are not records are dropped with one note, a lost step is said; every surviving
    line, and every step trained after the resume, is the uninterrupted run's."""
    cfg, out = _finished(corpus, tmp_path, iters=2, lr_decay_iters=4)
    log = out / 'metrics.jsonl'
    a, b = [l + b'\n' for l in log.read_bytes().splitlines()]
    damage, survive = LOG_DAMAGE[case]
    if damage is None: log.unlink()
    elif damage == 'fifo': log.unlink(); os.mkfifo(log)          # a read would wait for ever
    elif damage == 'sparse':                              # zeros, no newline: one huge line
        with open(log, 'ab') as f: f.truncate(len(a + b) + (256 << 20))
    else: log.write_bytes(damage(a, b))
    notes = []
    S.run(cfg._replace(iters=4), resume=True, progress=False, log=notes.append)
    tensors, rows, _ = reference
    assert _rows(out) == [r for r in rows if r['step'] in survive or r['step'] > 2]
    assert sum('dropped' in n for n in notes) <= 1
    assert any(f"holds {len(survive)} of the 2 steps" in n for n in notes) == (survive != [1, 2])
    got = _tensors(out)
    assert all(np.array_equal(got[k], tensors[k]) for k in tensors)


CONFIG_DAMAGE = {
    'missing': None, 'empty': b'', 'not JSON': b'{"run": ', 'not UTF-8': b'\xff\xfe{}',
    'a list': b'[]', 'run a number': b'{"run": 1, "model": [], "vocab": []}',
    'iters a string': None, 'vocab of numbers': None, 'nested 100000 deep': b'[' * 100_000,
    'a folder': None, 'a FIFO': None, 'a sparse 100 GiB': None,
}


@pytest.mark.parametrize('case', list(CONFIG_DAMAGE))
def test_a_damaged_configuration_is_refused_in_one_line(corpus, tmp_path, case):
    "`--resume` beside a config.json that is missing or not a run's: exit 1, one line naming it."
    cfg, out = _finished(corpus, tmp_path, iters=2)
    p = out / 'config.json'
    saved = json.loads(p.read_text())
    if case == 'missing': p.unlink()
    elif case == 'iters a string': p.write_text(json.dumps({**saved, 'run': {**saved['run'],
                                                                              'iters': '2'}}))
    elif case == 'vocab of numbers': p.write_text(json.dumps({**saved, 'vocab': [1, 2]}))
    elif case == 'a folder': p.unlink(); p.mkdir()
    elif case == 'a FIFO': p.unlink(); os.mkfifo(p)
    elif case == 'a sparse 100 GiB':
        with open(p, 'ab') as f: f.truncate(100 << 30)
    else: p.write_bytes(CONFIG_DAMAGE[case])
    with pytest.raises(CheckpointError, match=str(p)):
        S.run(cfg, resume=True, progress=False, log=quiet)
    status, err = _cli('--data', str(corpus), '--out', str(out), *FLAGS[2:], '--iters', '2',
                       '--resume')
    assert status == 1 and err.count('\n') == 1 and str(p) in err and 'Traceback' not in err, err


def test_stale_temporaries_are_removed_and_nothing_else(corpus, tmp_path, reference):
    """Temporaries of every run file and make_out's probe, as kills leave them, are removed at the
    next start, said in one line; lookalikes (other names, other patterns) stay."""
    cfg, out = _finished(corpus, tmp_path, iters=2, lr_decay_iters=4)
    stale = [f'.{n}.k1ll3d_x.tmp' for n in S.RUN_FILES] + ['.gradus-write-test.a1b2c3d4']
    kept = ['.ckpt.safetensors.tmp', '.ckpt.safetensors.K1LL3D_X.tmp', 'ckpt.safetensors.tmp',
            '.notes.txt.abcdefgh.tmp', '.gradus-write-test.a1b2', 'my-notes.txt']
    for n in stale + kept: (out / n).write_bytes(b'x')
    notes = []
    S.run(cfg._replace(iters=4), resume=True, progress=False, log=notes.append)
    assert f"removed {len(stale)} temporary files that an interrupted write left in {out}" in notes
    assert all((out / n).exists() for n in kept) and not any((out / n).exists() for n in stale)
    _same_as(reference, out)


# --- nothing non-finite -----------------------------------------------------------------------

def test_a_nan_in_training_is_one_line_and_saves_nothing(corpus, tmp_path):
    """--lr 1e10: the first update overflows the parameters and the next loss is NaN: exit 1, one
    line naming the step (numpy's overflow warnings silenced), and no checkpoint written; with a
    good checkpoint already there, it is kept byte for byte."""
    out = tmp_path / 'run'
    status, err = _cli('--data', str(corpus), '--out', str(out), *FLAGS, '--lr', '1e10')
    assert status == 1 and err == ("gradus shakespeare: fit: loss is nan at step 1; no checkpoint "
                                   "was written (a smaller --lr may help)\n"), err
    assert not (out / 'ckpt.safetensors').exists()
    cfg, out = _finished(corpus, tmp_path / 'b', iters=2, lr_decay_iters=4)
    good = (out / 'ckpt.safetensors').read_bytes()
    real = S.train._train_step
    def poisoned(vg, opt, params, opt_state, batch, t, clip_norm):   # overflows at step 4's
        p, s, rec = real(vg, opt, params, opt_state, batch, t, clip_norm)
        return ({**p, 'wte': p['wte'] * np.float32(np.inf)} if t == 3 else p), s, rec
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(S.train, '_train_step', poisoned)
        with pytest.raises(train.NonFiniteError, match=r"params\.wte contains"):
            S.run(cfg._replace(iters=4), resume=True, progress=False, log=quiet)
    assert (out / 'ckpt.safetensors').read_bytes() == good


def test_atomic_write_fsyncs_the_file_before_the_rename_and_the_folder_after(tmp_path,
                                                                            monkeypatch):
    events, real_fsync, real_replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, 'fsync', lambda fd: (events.append(('fsync', os.fstat(fd).st_ino)),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, 'replace', lambda a, b: (events.append(('replace', os.stat(a).st_ino)),
                                                     real_replace(a, b))[1])
    atomic_write(tmp_path / 'f.txt', lambda tmp: Path(tmp).write_text('x'))
    monkeypatch.undo()
    ino = (tmp_path / 'f.txt').stat().st_ino
    assert events == [('fsync', ino), ('replace', ino), ('fsync', tmp_path.stat().st_ino)]
