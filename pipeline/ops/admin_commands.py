"""`rollout configure`, `rollout purge`, `rollout acl` and `rollout functions load`:
a namespace's settings and keys, and the Redis users and scripts it runs with."""
from __future__ import annotations

import json

import click
import redis

from pipeline.cli_support import CREATE_OPTION, REPLICAS_OPTION, Context, Seconds, rich_console
from pipeline.control import DEFAULT_HEARTBEAT_S, HEARTBEATS_PER_LEASE
from pipeline.keys import check_namespace
from pipeline.ops.acl import Role
from pipeline.types import ReleasePolicy, choices
from pipeline.wording import counted


@click.command()
@click.option("--max-staleness", type=int,
              help="η: no group whose oldest token lags the trainer's weight version by more is trained; "
                   "admission is paced to (η + version + 1) · B groups. Negative: no bound.")
@click.option("--batch-size", type=int, help="B, the groups per training step that pacing counts with "
                                              "(next_batch must ask for exactly this many). Negative: unset.")
@click.option("--lease", "lease_s", type=Seconds(min=HEARTBEATS_PER_LEASE * DEFAULT_HEARTBEAT_S),
              help=f"Seconds a worker may go without a heartbeat before any worker or the trainer gives its "
                   f"groups back (at least {HEARTBEATS_PER_LEASE} heartbeats of {DEFAULT_HEARTBEAT_S:g}s).")
@click.option("--max-claims", type=click.IntRange(min=1),
              help="Claims of one group without it finishing (a worker died holding it) before it is "
                   "dead-lettered.")
@click.option("--max-ready", type=int, help="Results waiting for the trainer at which workers stop claiming. "
                                             "Negative: back to the default.")
@click.option("--release-policy", type=click.Choice(choices(ReleasePolicy)),
              help="What happens to aborted groups when admission reopens.")
@click.option("--json", "as_json", is_flag=True, help="Print the settings as one JSON object.")
@REPLICAS_OPTION
@CREATE_OPTION
@click.pass_obj
def configure(obj: Context, max_staleness, batch_size, lease_s, max_claims, max_ready, release_policy,
              as_json, replicas, create) -> None:
    """Show or change the namespace's settings (every worker and trainer follows them).

    Without options, prints the current settings. The staleness bound needs
    both --max-staleness and --batch-size, and the trainer must bump the weight
    version (`rollout resume --weight-version`, Controller.resume) once per
    batch, or admission stops when the budget is spent.

    \b
    JSON keys (stable; docs/cli.md): paused, weight_version, max_staleness,
    batch_size, max_ready, lease_s, max_claims, release_policy, version_clock,
    admitted, committed, budget_base, staleness_limit, draining.

    \b
    Example:
      rollout configure --max-staleness 1 --batch-size 64
      rollout configure --lease 20 --max-claims 5
      rollout --namespace exp2 configure --create --max-staleness 1 --batch-size 64   # before the first push
    """
    from pipeline.control import configure as set_settings
    from pipeline.retry import TRAINER_OUTAGE_LIMIT_S, Durability, Reconnect

    changes = (max_staleness, batch_size, lease_s, max_claims, max_ready, release_policy)
    if any(c is not None for c in changes):
        queue = obj.control_queue("configure", create)
    else:  # only shown
        queue = obj.queue()
        obj.warn_if_empty(queue)
    try:  # waited out like the trainer's calls: a replica catching up, a failover
        state = Reconnect("rollout configure", limit_s=TRAINER_OUTAGE_LIMIT_S).call(
            set_settings, queue.redis, queue.keys, max_staleness=max_staleness, batch_size=batch_size,
            max_ready=max_ready, lease_s=lease_s, max_claims=max_claims, release_policy=release_policy,
            durability=Durability(replicas))
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if max_ready is not None:
        _warn_if_batches_cannot_fill(queue, state)
    if as_json:
        click.echo(json.dumps(state.to_dict()))
        return
    if state.max_staleness is None:
        bound = "none"
    elif state.staleness_limit is None:  # η without B: checked when batches are taken, admission not paced
        bound = f"η={state.max_staleness}, checked at consumption only (no --batch-size: admission is not paced)"
        click.echo(f"warning: --max-staleness {state.max_staleness} without a batch size only drops stale groups "
                   f"when the trainer takes them; to pace admission add --batch-size B (the groups per step): "
                   f"rollout configure --max-staleness {state.max_staleness} --batch-size 64", err=True)
    else:
        bound = (f"η={state.max_staleness}, B={state.batch_size}: {state.admitted} of {state.staleness_limit} "
                 f"admitted at version {state.weight_version}")
    from pipeline.tables import Facts

    click.echo(f"namespace {obj.namespace!r}: {'paused' if state.paused else 'admitting'}")
    rich_console().print(Facts([("  staleness bound", [bound]), ("  lease", [f"{state.lease_s:g}s"]),
                                ("  max claims", [str(state.max_claims)]), ("  max ready", [str(state.max_ready)]),
                                ("  release policy", [str(state.release_policy)])]))


def _warn_if_batches_cannot_fill(queue, state) -> None:
    """A batch's groups all wait in the results stream until it is committed: a max_ready
    below the batch the running trainer asks for (or below B) holds it forever."""
    from pipeline.control import running_batch

    running = running_batch(queue.redis, queue.keys)
    if running and running[1] > state.max_ready:
        click.echo(f"warning: trainer session {running[0]} asks for batches of {running[1]} groups: with "
                   f"--max-ready {state.max_ready} they can never fill (workers stop claiming once max_ready "
                   f"results wait); raise it to at least {running[1]}", err=True)
    elif state.batch_size and state.batch_size > state.max_ready:
        click.echo(f"warning: the batch size B is {state.batch_size}: with --max-ready {state.max_ready} a batch "
                   f"of B can never fill; raise it to at least {state.batch_size}", err=True)


@click.command()
@click.option("--yes", is_flag=True, help="Really delete (required).")
@click.pass_obj
def purge(obj: Context, yes) -> None:
    """Delete every key of one namespace (and nothing else).

    Removes the prompts, payloads, streams, in-flight sets, counters, dataset
    cursors and control settings of --namespace, found with SCAN on the
    namespace's hash tag. Other namespaces on the same Redis are untouched.
    Refuses without --yes.

    \b
    Example:
      rollout --namespace scratch purge --yes
    """
    from pipeline.ops.admin import namespace_keys, purge as purge_keys

    queue = obj.queue()
    n_keys = sum(1 for _ in namespace_keys(queue.redis, obj.namespace))
    if n_keys == 0:
        click.echo(f"namespace {obj.namespace!r} is already empty: nothing to delete")
        return
    if not yes:
        raise click.ClickException(f"purge deletes all {counted(n_keys, 'key')} of namespace {obj.namespace!r}; "
                                   "re-run with --yes to do it")
    live = queue.live_workers()
    if live:
        still = "still uses" if len(live) == 1 else "still use"
        click.echo(f"warning: {counted(len(live), 'live worker')} {still} namespace {obj.namespace!r}: they register "
                   "anew at once, under the default settings (the namespace's settings, such as its lease, go with "
                   "its keys: `rollout configure` them again), unless you stop them first", err=True)
    with rich_console(stderr=True).status(f"deleting {counted(n_keys, 'key')} ..."):
        deleted = purge_keys(queue.redis, obj.namespace)
    click.echo(f"purged namespace {obj.namespace!r}: {counted(deleted, 'key')} deleted")


@click.command()
@click.option("--role", required=True, type=click.Choice([r.value for r in Role]),
              help="worker: generate; trainer: push, consume, pause/resume; admin: also status, audit, "
                   "dead letters, purge.")
@click.option("--namespace", "role_namespace", help="The namespace the user may use. Default: --namespace.")
@click.option("--user", help="User name. Default: NAMESPACE-ROLE.")
@click.option("--password", envvar="ROLLOUT_ACL_PASSWORD",
              help="The user's password (env ROLLOUT_ACL_PASSWORD). Default: a new random one, shown once "
                   "on stderr. The line carries only its SHA-256.")
@click.option("--functions", is_flag=True,
              help="Redis 7 with the Functions library loaded (`rollout functions load`): the user runs the "
                   "pipeline's Lua by FCALL only, never EVAL, EVALSHA, SCRIPT or FUNCTION.")
@click.pass_obj
def acl(obj: Context, role, role_namespace, user, password, functions) -> None:
    """Print the ACL SETUSER line of a least-privilege Redis user for one role.

    The user may touch only the namespace's keys ({NS}:*) and its events
    channel, run only the commands the role sends (those inside the Lua scripts
    included), and take entries out of only the streams the role settles (a
    worker cannot settle the trainer's results). Connects to nothing.

    \b
    Example:
      rollout acl --role worker --namespace exp1 | redis-cli -h redis-host
      ROLLOUT_ACL_PASSWORD=... rollout acl --role trainer --namespace exp1
    """
    import secrets

    from pipeline.ops.acl import default_user, setuser_line

    namespace = role_namespace or obj.namespace
    try:
        check_namespace(namespace)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--namespace") from None
    role = Role(role)
    user = user or default_user(role, namespace)
    if not user.isprintable() or any(c in user for c in " ()\"'"):
        raise click.BadParameter(f"{user!r} cannot be a Redis user name: no spaces, quotes or parentheses",
                                 param_hint="--user")
    if not password:
        password = secrets.token_urlsafe(24)
        click.echo(f"password for Redis user {user!r} (shown once): {password}\n"
                   f"connect as redis://{user}:{password}@HOST:PORT", err=True)
    click.echo(setuser_line(role, namespace, user, password, functions))


@click.group()
def functions() -> None:
    """The Redis 7 Functions library of the pipeline's Lua scripts.

    \b
    Example:
      rollout --redis-url redis://admin:PASSWORD@redis-host:6379 functions load
    """


@functions.command("load")
@click.pass_obj
def functions_load(obj: Context) -> None:
    """Load (or replace) the library on the server, as an admin, once per server and
    version. Users made with `rollout acl --functions` then run the pipeline's scripts
    by FCALL and may run no other Lua.

    \b
    Example:
      rollout --redis-url redis://admin:PASSWORD@redis-host:6379 functions load
    """
    from pipeline import scripts

    queue = obj.queue()
    try:
        digest = scripts.load_library(queue.redis)
    except redis.ResponseError as exc:
        raise click.ClickException(obj.scrub(f"cannot load the Functions library (Redis 7 or later, as a user "
                                             f"allowed FUNCTION LOAD): {exc}")) from None
    click.echo(f"Functions library {scripts.LIBRARY!r} version {digest} loaded ({len(scripts.names())} scripts)")
