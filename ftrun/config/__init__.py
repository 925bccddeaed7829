"""The job specification and where its values come from.

One :class:`JobSpec` describes a job. Each option is declared once, as a field of
:class:`JobSpec` (:mod:`ftrun.config.options`), and has three spellings that resolve with this
precedence (highest first):

1. a command-line flag (``--worker_num 4`` or ``--worker-num 4``; torchrun's own flags at the same
   level, :mod:`ftrun.config.torchrun`),
2. an environment variable ``FTRUN_<OPTION>`` (``FTRUN_WORKER_NUM=4``),
3. a TOML key (``worker_num = 4``) in the ``--config FILE`` file, else in ``[tool.ftrun]`` of
   ``./pyproject.toml``,
4. a cluster's environment, when the launcher runs under one (:func:`read_cluster_env`): Slurm's
   ``SLURM_NNODES``, ``SLURM_NODEID``, ``SLURM_JOB_NODELIST``, or a Kubeflow PyTorchJob's
   ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``, ``PET_NPROC_PER_NODE``,
5. the default. A multi-node job whose node index none of these gives decides it at start
   (``JobSpec.node_rank_auto``).

Fault-tolerance switches use MindSpore's ``MS_ENABLE_TFT`` form, e.g. ``'{ARF:1,TTP:1,UCE:1}'``
(separators may be commas or spaces; ``FTRUN_TFT`` wins over ``MS_ENABLE_TFT``). As in MindSpore,
UCE and ARF imply TTP. With no switch given anywhere, all four are on.

Every value is converted and range-checked where it is read (each number option has bounds, shown
in ``--help``; a TOML value must have the option's TOML type), and the combination is checked by
:func:`resolve`, which also resolves addresses, tries the checkpoint directory, parses
``FTRUN_FAULT`` and, for a multi-node job, reads the shared secret (:func:`read_job_token`).

Modules, by role (imports flow one way: options <- checks <- sources, torchrun <- resolve):

- :mod:`~ftrun.config.options`: :class:`Option`, :class:`JobSpec` (the options' one declaration),
  :data:`OPTIONS`, the bounds, :class:`ConfigError`;
- :mod:`~ftrun.config.checks`: single values (text, switches, addresses, script, directories,
  ``FTRUN_FAULT``, the job's secret, device counts);
- :mod:`~ftrun.config.sources`: ``FTRUN_<OPTION>``, TOML, Slurm's and a PyTorchJob's environment;
- :mod:`~ftrun.config.torchrun`: torchrun's flags and names (:class:`TorchrunFlags`);
- :mod:`~ftrun.config.resolve`: :func:`resolve`.

Every error a user can cause raises :class:`ConfigError` whose message is one line naming the
problem and the fix; the CLI prints it and exits with code 2.
"""

from __future__ import annotations

from ftrun.config.checks import (
    check_address,
    check_faults,
    check_script,
    check_text,
    check_writable_dir,
    convert_text,
    count_local_devices,
    parse_nnodes,
    parse_tail,
    parse_tft,
    read_job_token,
)
from ftrun.config.options import (
    DEFAULT_RDZV_PORT,
    MAX_CONFIG_BYTES,
    MAX_INTERVAL_S,
    MAX_LOCAL_WORKERS,
    MAX_STEPS,
    MAX_TIMEOUT_S,
    MAX_TOKEN_FILE_BYTES,
    MAX_WORLD_SIZE,
    MIN_TOKEN_CHARS,
    OPTIONS,
    OPTIONS_BY_NAME,
    TFT_IMPLEMENTED,
    TFT_SWITCHES,
    TIMEOUT_WHY,
    ConfigError,
    JobSpec,
    Option,
    TftSwitches,
    format_number,
    option,
    relay_fits,
)
from ftrun.config.resolve import resolve
from ftrun.config.sources import (
    ClusterEnv,
    convert_toml,
    expand_hostlist,
    first_host,
    iter_hostlist,
    read_cluster_env,
    read_env,
    read_toml,
)
from ftrun.config.torchrun import (
    DEVICE_COUNT_ALIAS,
    RDZV_CONF_KEYS,
    START_METHODS,
    UNSUPPORTED_TORCHRUN_FLAGS,
    TorchrunFlags,
    apply_torchrun,
    merge_aliases,
    parse_rdzv_conf,
    parse_rdzv_endpoint,
    parse_std_streams,
    torchrun_flag,
)

__all__ = [
    "DEFAULT_RDZV_PORT", "DEVICE_COUNT_ALIAS", "MAX_CONFIG_BYTES", "MAX_INTERVAL_S", "MAX_LOCAL_WORKERS", "MAX_STEPS",
    "MAX_TIMEOUT_S", "MAX_TOKEN_FILE_BYTES", "MAX_WORLD_SIZE", "MIN_TOKEN_CHARS", "OPTIONS", "OPTIONS_BY_NAME",
    "RDZV_CONF_KEYS", "START_METHODS", "TFT_IMPLEMENTED", "TFT_SWITCHES", "TIMEOUT_WHY", "UNSUPPORTED_TORCHRUN_FLAGS",
    "ClusterEnv", "ConfigError", "JobSpec", "Option", "TftSwitches", "TorchrunFlags", "apply_torchrun",
    "check_address", "check_faults", "check_script", "check_text", "check_writable_dir", "convert_text",
    "convert_toml", "count_local_devices", "expand_hostlist", "first_host", "format_number", "iter_hostlist",
    "merge_aliases", "option", "relay_fits", "parse_nnodes", "parse_rdzv_conf", "parse_rdzv_endpoint", "parse_std_streams",
    "parse_tail", "parse_tft", "read_cluster_env", "read_env", "read_job_token", "read_toml", "resolve",
    "torchrun_flag",
]
