"""megabert's tests: a package, so that tests import shared code as `tests.helpers.*` (pytest
puts the repo root on sys.path: pyproject's `pythonpath`), and spawned workers find the
modules their functions come from."""
