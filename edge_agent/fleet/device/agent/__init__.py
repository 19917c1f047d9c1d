"""The box's own software as a release: agent versions installed side by side, switched
to, proven, and put back by themselves.

    <fleet.agent_releases_dir>/0.2.0/         a version's virtual environment (`slots`)
    <fleet.agent_releases_dir>/current        -> 0.2.0: what the service runs (absent: the
                                              version the Ansible role installed, "base")
    <state_dir>/agent/trial.json              a switch not yet proven (`trial`)
    <state_dir>/agent/snapshots/<rollout>/    the state databases as they were before it

Who does what:

- the rollout runner of the running version (`rollout.agent_release`) installs the new
  version (`slots.install`: `pip --no-index` from the verified wheelhouse, then llama.cpp
  loaded there in a child), records the baseline, snapshots the databases (`snapshot`),
  writes the trial, switches `current`, and asks systemd for a restart (exit 75);
- the service's own entry (`edge-agent serve` of the base install, never upgraded over the
  fleet) reads the trial at every start before anything opens a database (`boot`): it
  counts the new version's starts and execs it, or, once the trial failed, ran out of
  starts or of time, switches `current` back and restores the databases (rows the new
  version wrote carried over), then runs the previous version;
- the new version's runner gates it against the baseline and commits it, or records why
  not and asks for a restart, so that the entry puts the previous one back.

Never: run a version whose install did not finish, roll back while a process holds the
databases, or change the base install (that stays the role's).
"""
