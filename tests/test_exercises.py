"""The exercises check themselves, and the checks can fail: every registered exercise's check passes
its reference solution, refuses each of its wrong answers with a message that names the input, and
reports a blank answer as not attempted; every lesson notebook ends with 2-4 exercises."""
import importlib, json, pkgutil, re
from pathlib import Path
import pytest
import gradus.exercises
from gradus.exercises.checking import REGISTRY

ROOT = Path(__file__).resolve().parents[1]
for m in pkgutil.iter_modules(gradus.exercises.__path__):
    importlib.import_module(f'gradus.exercises.{m.name}')
NAMES = sorted(REGISTRY)
# Lesson notebooks: NN_name.ipynb in a wing folder (companions NNa_ need no exercises; the
# command line's plumbing, jobs/29_cli, and the exercises wing itself are not lessons).
NOT_LESSONS = {'jobs/29_cli'}
LESSONS = sorted(f"{p.parent.name}/{p.stem}" for p in (ROOT / 'nbs').glob('*/[0-9][0-9]_*.ipynb')
                 if p.parent.name != 'exercises' and f"{p.parent.name}/{p.stem}" not in NOT_LESSONS)


NEEDS = {'take_along_rule': 'jax'}   # exercises whose check needs an optional extra


def _blank(*args, **kwargs): raise NotImplementedError


def _needs(name):
    if name in NEEDS: pytest.importorskip(NEEDS[name])


@pytest.mark.parametrize('name', NAMES)
def test_check_passes_its_solution(name):
    _needs(name)
    ex = REGISTRY[name]
    r = ex.check(ex.solution, quiet=True)
    assert r.status == 'pass', r.message


@pytest.mark.parametrize('name', NAMES)
def test_check_refuses_each_wrong_answer_naming_the_input(name):
    _needs(name)
    ex = REGISTRY[name]
    assert len(ex.wrong) >= 2, f"{name}: fewer than two wrong answers"
    for w in ex.wrong:
        r = ex.check(w, quiet=True)
        assert r.status == 'fail', f"{name}: the check passed the wrong answer {w.__name__}"
        assert 'for input' in r.message and r.case is not None, r.message


@pytest.mark.parametrize('name', NAMES)
def test_blank_answer_is_not_attempted(name):
    _needs(name)
    assert REGISTRY[name].check(_blank, quiet=True).status == 'not attempted'


def _notebook_source(lesson):
    nb = json.loads((ROOT / 'nbs' / f'{lesson}.ipynb').read_text())
    return '\n'.join(''.join(c['source']) for c in nb['cells'])


def test_every_lesson_has_two_to_four_exercises_that_its_notebook_calls():
    "A table: lesson, exercises, wrong answers refused; each lesson has 2-4 and calls each check."
    rows, problems = [], []
    for lesson in LESSONS:
        exs = [e for e in REGISTRY.values() if e.lesson == lesson]
        src = _notebook_source(lesson)
        for e in exs:
            if not re.search(rf'\b{re.escape(e.check.__name__)}\(', src):
                problems.append(f"{lesson}: never calls {e.check.__name__}")
        if not 2 <= len(exs) <= 4: problems.append(f"{lesson}: {len(exs)} exercises (2-4 wanted)")
        rows.append((lesson, len(exs), sum(len(e.wrong) for e in exs)))
    unknown = sorted({e.lesson for e in REGISTRY.values()} - set(LESSONS))
    problems += [f"exercise registered for {u}, which is not a lesson notebook" for u in unknown]
    print('\nlesson                          exercises  wrong answers refused')
    for lesson, n, w in rows: print(f"{lesson:32} {n:9} {w:22}")
    print(f"{'total':32} {sum(r[1] for r in rows):9} {sum(r[2] for r in rows):22}")
    assert not problems, '\n'.join(problems)
