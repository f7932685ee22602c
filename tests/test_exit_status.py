"""The exit statuses of the `gradus` command (`gradus.jobs.cli.main`), one convention for every
command: 0 done; 2 the command line is wrong (argparse's usage errors, a flag's value out of its
range: `ConfigError`); 1 the run was refused or failed (any other `GradusError`, an `OSError`);
130 interrupted. Each refusal is one line on stderr; anything else keeps its traceback.
"""

import inspect

import pytest

from gradus import errors
from gradus.jobs import cli
from gradus.jobs.cli import main

GRADUS_ERRORS = [c for _, c in inspect.getmembers(errors, inspect.isclass)
                 if issubclass(c, errors.GradusError)]


def _err_lines(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line]


@pytest.mark.parametrize('argv', [['nope'], [], ['generate'], ['generate', 'hi', '--top-k', 'x'],
                                  ['chat', '--context', 'wide'], ['inspect', 'f', '--bogus']])
def test_usage_errors_return_2_in_one_line(argv, capsys):
    assert main(argv) == 2                                  # returned, not raised
    err = _err_lines(capsys)
    assert len(err) == 1 and err[0].startswith('gradus') and '--help' in err[0], err


def test_help_returns_0(capsys):
    assert main(['generate', '--help']) == 0
    assert '--max-new-tokens' in capsys.readouterr().out


@pytest.mark.parametrize('argv, flag', [
    (['generate', 'hi', '--top-p', '2'], '--top-p'),
    (['generate', 'hi', '--max-new-tokens', '0'], '--max-new-tokens'),
    (['generate', 'hi', '--max-new-tokens', '-3'], '--max-new-tokens'),
    (['generate', 'hi', '--threads', '0'], '--threads'),
    (['chat', '--context', '0'], '--context'),
    (['chat', '--temperature', '-1'], '--temperature'),
])
def test_flag_values_out_of_range_return_2_before_any_file(argv, flag, capsys):
    "`--gguf` names a file that does not exist: the flag is refused before it would be opened."
    assert main([*argv, '--gguf', 'absent.gguf']) == 2
    err = _err_lines(capsys)
    assert len(err) == 1 and err[0].startswith(f'gradus {argv[0]}: ConfigError: {flag} '), err


def _stand_in(monkeypatch, error):
    "A command `raise` whose run raises `error`."
    def run(args):
        raise error
    monkeypatch.setitem(cli.COMMANDS, 'raise', ('raise an error', lambda p: None, run))


@pytest.mark.parametrize('cls', GRADUS_ERRORS, ids=lambda c: c.__name__)
def test_every_gradus_error_of_any_command_is_one_line(cls, monkeypatch, capsys):
    _stand_in(monkeypatch, cls('what went wrong, naming the value'))
    want = 2 if issubclass(cls, errors.ConfigError) else 1
    assert main(['raise']) == want == cli.exit_status(cls('x'))
    line = f'gradus raise: {cls.__name__}: what went wrong, naming the value'
    assert _err_lines(capsys) == [line]


@pytest.mark.parametrize('error', [FileNotFoundError(2, 'No such file or directory', 'x.gguf'),
                                   PermissionError(13, 'Permission denied', 'out/'),
                                   IsADirectoryError(21, 'Is a directory', 'out')])
def test_file_errors_are_1(error, monkeypatch, capsys):
    _stand_in(monkeypatch, error)
    assert main(['raise']) == 1
    err = _err_lines(capsys)
    assert len(err) == 1 and err[0].startswith(f'gradus raise: {type(error).__name__}: '), err


def test_ctrl_c_is_130_without_traceback(monkeypatch, capsys):
    _stand_in(monkeypatch, KeyboardInterrupt())
    assert main(['raise']) == 130
    assert _err_lines(capsys) == ['gradus raise: interrupted']


def _numba_report_of_ctrl_c(args):
    """What CPython raises when Ctrl-C's interrupt is pending as a compiled numba function returns:
    a SystemError whose context is the KeyboardInterrupt."""
    try: raise KeyboardInterrupt
    except KeyboardInterrupt:
        raise SystemError('CPUDispatcher(<function k>) returned a result with an exception set')


def test_ctrl_c_inside_a_kernel_is_130_without_traceback(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, 'raise', ('raise', lambda p: None, _numba_report_of_ctrl_c))
    assert main(['raise']) == 130
    assert _err_lines(capsys) == ['gradus raise: interrupted']


def test_a_system_error_of_its_own_keeps_its_traceback(monkeypatch):
    _stand_in(monkeypatch, SystemError('a bug in an extension'))
    with pytest.raises(SystemError, match='a bug in an extension'):
        main(['raise'])


def test_a_bug_keeps_its_traceback(monkeypatch):
    _stand_in(monkeypatch, RuntimeError('a bug'))
    with pytest.raises(RuntimeError, match='a bug'):
        main(['raise'])
    with pytest.raises(TypeError, match='RuntimeError is not an error gradus reports'):
        cli.exit_status(RuntimeError('a bug'))


def test_the_convention_is_documented_in_main():
    doc = ' '.join(main.__doc__.split())
    for words in ('0: done', '2: the command line is wrong', '1: the run was refused or failed',
                  '130: interrupted', 'ConfigError', 'MemoryBudgetError', 'OSError'):
        assert words in doc, words


def test_gradus_help_states_the_convention(capsys):
    "`gradus --help` names each status; the tests above hold `main` to the same numbers."
    assert main(['--help']) == 0
    help_ = ' '.join(capsys.readouterr().out.split())
    assert ('exit status: 0 done; 1 refused (a file or input gradus cannot use); 2 a wrong command'
            ' line or flag value; 130 interrupted (Ctrl-C)') in help_, help_
