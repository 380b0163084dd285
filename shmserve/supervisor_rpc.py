"""supervisord's ``shmserve`` XML-RPC namespace: one process of a group made as the config file
says now, the others left running (`shmserve apply`).

supervisord changes process groups only whole: `supervisorctl update` stops every process of a
group whose section changed (a frontend added to ``[group:frontends]`` restarted them all), and
its API adds and removes groups, not processes. ``syncProcess(group, name)`` re-reads the config
file, as ``reloadConfig`` does, and makes the live group's process ``name`` match it: added
(started by supervisord as any autostart process is), removed or replaced (both only once
stopped; one replaced while stopped by a command stays stopped), in the file's order, so that
once every process is synced the group's config equals the file's and a later `update` sees
nothing to change. supervisor_twiddler's
``addProgramToGroup`` / ``removeProcessFromGroup`` do the first two from options sent over RPC,
but append at the group's end and cannot replace one in place.

Loaded by supervisord at its start (``[rpcinterface:shmserve]`` in supervisord.conf), so it runs
inside supervisord's process and uses its internals, as supervisor's own rpcinterface does: the
version is pinned (constraints.txt) and tests/integration/test_apply.py drives it through a real
supervisord.
"""

from __future__ import annotations

from supervisor.states import STOPPED_STATES, ProcessStates, SupervisorStates
from supervisor.xmlrpc import Faults, RPCError

API_VERSION = "1"


class ShmserveNamespace:
    def __init__(self, supervisord) -> None:
        self.supervisord = supervisord

    def getAPIVersion(self) -> str:  # noqa: N802 - supervisor's RPC naming
        """The version of this namespace: `shmserve apply` checks it is there at all.

        @return string version
        """
        return API_VERSION

    def pending(self, group_names: list) -> dict:
        """The processes of `group_names` the config file has and supervisord does not run
        (added), runs and the file has not (removed), or runs as the file no longer says
        (changed), as GROUP:NAME.

        @param array group_names   groups running now
        @return struct {"added": [...], "removed": [...], "changed": [...]}
        """
        out: dict[str, list[str]] = {"added": [], "removed": [], "changed": []}
        for group_name in group_names:
            group, wanted_group = self._groups(group_name)
            wanted = {c.name: c for c in wanted_group.process_configs}
            for name, config in wanted.items():
                process = group.processes.get(name)
                if process is None:
                    out["added"].append(f"{group_name}:{name}")
                elif process.config != config:
                    out["changed"].append(f"{group_name}:{name}")
            out["removed"] += [f"{group_name}:{name}" for name in group.processes
                               if name not in wanted]
        return out

    def syncProcess(self, group_name: str, process_name: str,  # noqa: N802
                    running: bool = False) -> str:
        """Make process `process_name` of group `group_name` as the config file says now.

        @param string group_name    a group running now (frontends, workers)
        @param string process_name  a process of it, in the file or running or both
        @param boolean running      a running process takes the file's settings without a
                                    stop, for its next start (nginx: its stop timeout, logs)
        @return string what was done: added, removed, replaced, adopted or unchanged
        """
        group, wanted_group = self._groups(group_name)
        wanted = next((c for c in wanted_group.process_configs if c.name == process_name),
                      None)
        process = group.processes.get(process_name)
        if process is None and wanted is None:
            raise RPCError(Faults.BAD_NAME, process_name)
        if process is not None and wanted is not None and process.config == wanted:
            self._place(group, wanted_group, wanted, process_name)
            return "unchanged"
        stopped = process is None or (not process.pid
                                      and process.get_state() in STOPPED_STATES)
        if not stopped and running and wanted is not None:
            wanted.create_autochildlogs()
            process.config = wanted
            self._place(group, wanted_group, wanted, process_name)
            return "adopted"
        if not stopped:
            raise RPCError(Faults.STILL_RUNNING, process_name)
        if wanted is None:
            del group.processes[process_name]
            self._place(group, wanted_group, None, process_name)
            return "removed"
        wanted.create_autochildlogs()
        made = wanted.make_process(group)
        if process is not None and process.get_state() == ProcessStates.STOPPED:
            # Stopped by a command (an operator's `shmserve ctl stop`, or the apply that starts
            # it next): it stays stopped. supervisord autostarts a process it never started
            # (laststart 0): a stopped worker was started again by an apply.
            made.laststart = process.laststart
        group.processes[process_name] = made
        self._place(group, wanted_group, wanted, process_name)
        return "added" if process is None else "replaced"

    def _groups(self, group_name: str):
        """The live group `group_name` and the file's, read again now."""
        if self.supervisord.get_state() == SupervisorStates.SHUTDOWN:
            raise RPCError(Faults.SHUTDOWN_STATE)
        group = self.supervisord.process_groups.get(group_name)
        if group is None:
            raise RPCError(Faults.BAD_NAME, f"group {group_name}")
        try:
            self.supervisord.options.process_config(do_usage=False)
        except ValueError as exc:
            raise RPCError(Faults.CANT_REREAD, str(exc)) from None
        wanted_group = next((g for g in self.supervisord.options.process_group_configs
                             if g.name == group_name), None)
        if wanted_group is None:
            raise RPCError(Faults.BAD_NAME, f"group {group_name} is no longer in the file")
        return group, wanted_group

    @staticmethod
    def _place(group, wanted_group, wanted, name: str) -> None:
        """The live group's config: `name`'s entry as the file has it (or gone), every other
        entry as it runs, in the file's order, then what the file no longer has."""
        running = {c.name: c for c in group.config.process_configs if c.name != name}
        if wanted is not None:
            running[name] = wanted
        order = [c.name for c in wanted_group.process_configs]
        group.config.process_configs[:] = (
            [running[n] for n in order if n in running]
            + [c for n, c in running.items() if n not in order])


def make_rpcinterface(supervisord, **_config) -> ShmserveNamespace:
    return ShmserveNamespace(supervisord)
