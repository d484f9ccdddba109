"""lm-eval's index of its built-in tasks, kept in this machine's cache instead of read again by every process.

A TaskManager that knows lm-eval's own tasks (recipes.eval tasks=[arc_easy], a training run's eval_tasks=) first
parses every YAML file lm-eval ships, 14,000 of them: about 4 s of CPU a process on a 2-core machine, 10 s from a
cold disk, before a single document is read. What it builds from them (each task, group and tag: its name, kind,
file and unresolved config) depends on those files alone, so it is written once to MOAI_CACHE as JSON, under a
fingerprint of lm-eval's version and every YAML file's path, size and modification time (a walk of 0.1 s: an edited
or upgraded lm-eval is indexed again), and read back in about half a second. JSON, not a pickle: a shared cache
folder must not be a way to run code in whoever reads it.

The one place lm-eval is entered for it: `TaskIndex.build`, which TaskManager calls with the built-in folder first
and the user's task folders after (lm-eval >= 0.4.10). Only that folder's part is taken from the cache; the user's
are indexed as lm-eval indexes them and laid over it as lm-eval lays them (a user's task of a built-in name wins,
with lm-eval's warning). Any other lm-eval indexes as it always does.
"""

import contextlib
import hashlib
import json
import logging
import os
from pathlib import Path

from moai_recipes.files import cache_dir, write_text

_VERSION = 1  # of the stored form


@contextlib.contextmanager
def builtin_tasks_cached(folder: Path | None = None):
    """Within it, a TaskManager made with lm-eval's built-in tasks reads their index from this machine's cache.
    `folder`: the folder taken for lm-eval's own (its `tasks` package; a test gives a small one)."""
    try:
        import lm_eval.tasks
        from lm_eval.tasks._index import TaskIndex
    except ImportError:  # an lm-eval that indexes otherwise (before 0.4.10): as it does
        yield
        return
    built = TaskIndex.__dict__.get("build")
    if not isinstance(built, staticmethod):
        yield
        return
    build, builtin = built.__func__, Path(folder or Path(lm_eval.tasks.__file__).parent)

    def cached_build(paths, *args, **kwargs):
        paths = [Path(p) for p in paths]
        if args or kwargs or not paths or paths[0] != builtin:
            return build(paths, *args, **kwargs)
        index = _builtin_index(builtin, lambda: build([builtin]))
        for name, entry in build(paths[1:]).items():
            if name in index:  # lm-eval's own words for a later folder's task of an earlier name
                logging.getLogger("lm_eval.tasks._index").warning(
                    "Task '%s' from %s overrides existing task from %s", name, entry.yaml_path, index[name].yaml_path)
            index[name] = entry
        return index

    TaskIndex.build = staticmethod(cached_build)
    try:
        yield
    finally:
        TaskIndex.build = built


def _builtin_index(folder: Path, build) -> dict:
    import lm_eval
    from lm_eval.tasks._index import Entry, Kind

    path = cache_dir() / "lm-eval-tasks" / f"{_fingerprint(folder, getattr(lm_eval, '__version__', '?'))}.json"
    try:
        stored = json.loads(path.read_text())
        return {name: Entry(name=name, kind=Kind[kind], yaml_path=Path(file) if file else None, cfg=cfg,
                            tags=set(tags))
                for name, (kind, file, cfg, tags) in stored.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # not there yet, or damaged: indexed again
        pass
    index = build()
    stored = {name: (e.kind.name, str(e.yaml_path) if e.yaml_path else None, e.cfg, sorted(e.tags))
              for name, e in index.items()}
    try:
        text = json.dumps(stored, allow_nan=False)
    except (TypeError, ValueError):  # a config JSON cannot hold as it is (none in lm-eval 0.4.13): not stored
        return index
    with contextlib.suppress(OSError):  # a cache: a read-only home only costs the index next time
        write_text(path, text)
    return index


def _fingerprint(folder: Path, version: str) -> str:
    digest = hashlib.sha256(f"{_VERSION} {version} {folder}".encode())
    for where, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".yaml"):
                stat = os.stat(os.path.join(where, name))
                digest.update(f"{where}/{name} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:24]
