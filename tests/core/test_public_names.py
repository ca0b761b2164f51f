"""The public surface: what `from duplex_actors import *` and `duplex_actors.errors` promise."""

import inspect

import duplex_actors
from duplex_actors import errors


def test_every_error_class_is_exported_by_errors_and_the_package():
    classes = {
        name
        for name, value in vars(errors).items()
        if inspect.isclass(value)
        and issubclass(value, errors.DuplexError)
        and value.__module__ == errors.__name__
    }
    assert classes == set(errors.__all__)
    assert classes <= set(duplex_actors.__all__)


def test_every_name_in_all_exists_and_appears_once():
    assert len(duplex_actors.__all__) == len(set(duplex_actors.__all__))
    missing = [name for name in duplex_actors.__all__ if not hasattr(duplex_actors, name)]
    assert missing == []


def test_the_package_ships_its_type_marker():
    from importlib import resources

    assert resources.files("duplex_actors").joinpath("py.typed").is_file()
