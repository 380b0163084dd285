"""What an apply leaves out of the running config's sources: the config files and SHMSERVE__
variables `up` (or the last apply) read that this apply does not, where a key they set changes.
Said before an apply's checks, as a refusal's reason may be a change the operator did not mean
(an override of `up`'s left out, `--env prod` forgotten)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from shmserve import configview, layers, topology
from shmserve.config import Config
from shmserve.typedtree import ConfigError


def left_out(running: Config, env: str | None, extra: str | None, environ: Mapping[str, str],
             changed: list[str]) -> list[str]:
    """The warnings of the files and variables `running` was read from that this apply's
    (`env`, `extra`, `environ`) leaves out, where a key of `changed` is one they set."""
    warnings = []
    if dropped := files_dropped(running, layers.file_layers(env, extra, environ), changed):
        warnings.append(f"the running config was read from {', '.join(dropped)}, which this "
                        f"apply does not read ({_how_given(dropped)}, as `up` or the last apply "
                        "was given it): the keys only it set go back to the other layers' "
                        "values")
    if gone := variables_dropped(running, environ, changed):
        warnings.append(f"the running config was given {', '.join(gone)}, which this apply's "
                        "environment does not set (give them again, as `up` or the last apply "
                        "was given them): the keys they set go back to the files' values")
    return warnings


def files_dropped(running: Config, reading: list[Path], changed: list[str]) -> list[str]:
    """The config files the running config was read from (`up`'s or the last apply's, as the
    run directory keeps them) that `reading` leaves out, where a key one set changes (`changed`:
    the keys this apply changes): an apply without `up`'s --config put every key that file set
    back (the port too), and said nothing but the differences (an outside check moved a
    deployment to port 8080 so). One no longer readable counts as changing."""
    now = {str(path.resolve()) for path in reading}
    dropped = []
    for path in topology.config_files(running) or {}:
        if path in now:
            continue
        try:
            keys = list(configview.flat_tree(layers.read_yaml(Path(path))))
        except ConfigError:
            keys = [""]  # every key
        if _touches(keys, changed):
            dropped.append(path)
    return dropped


def variables_dropped(running: Config, environ: Mapping[str, str],
                      changed: list[str]) -> list[str]:
    """The SHMSERVE__ variables the running config was read with that `environ` lacks, where
    the key one set changes (`changed`: the keys this apply changes): an outside check's apply
    left out `up`'s SHMSERVE__SERVER__PORT, and the port went back to the file's, said among
    the differences only; another's file set the same port, and the warning said it moved."""
    return [name for name in topology.config_variables(running) if name not in environ
            and _touches([layers.variable_key(name)], changed)]


def _touches(keys: list[str], changed: list[str]) -> bool:
    """Whether any of `keys` (dotted paths, "" the whole config) is, holds or is held by a
    key in `changed` (a section set whole; a list's item, which changes the list)."""
    return any(key == c or not key or c.startswith(f"{key}.") or key.startswith(f"{c}.")
               for key in keys for c in changed)


def _how_given(dropped: list[str]) -> str:
    """How each dropped file is given: an env's (configs/<env>.yaml) with --env, any other with
    --config (the hint named --config for `up --env prod`'s file: an outside check)."""
    ways = []
    for path in dropped:
        name = Path(path)
        env = name.stem if (name.parent == layers.CONFIG_DIR.resolve() and name.suffix == ".yaml"
                            and name.stem in layers.env_names()) else ""
        ways.append(f"give --env {env} or SHMSERVE_ENV={env}" if env
                    else f"give {name.name} with --config or SHMSERVE_CONFIG")
    return "; ".join(dict.fromkeys(ways))
