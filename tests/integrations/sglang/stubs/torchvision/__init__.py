"""Test-only stand-in for torchvision: every name imports, nothing runs."""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"


class _PlaceholderMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")


def _placeholder(qualname):
    def _unavailable(*args, **kwargs):
        raise NotImplementedError(f"torchvision stub: {qualname} is not available in this test environment")

    return _PlaceholderMeta(
        qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname, "__new__": _unavailable}
    )


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _StubModule(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module):
        pass


sys.meta_path.append(_StubFinder())


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return importlib.import_module(f"{__name__}.{name}")
