"""`rollout dead list / show / retry / drop`: dead letters with their errors
(pipeline/ops/deadletters.py)."""
from __future__ import annotations

import click

from pipeline.cli_support import Context, rich_console, dump
from pipeline.tables import Col
from pipeline.wording import counted


@click.group()
def dead() -> None:
    """Inspect dead letters with their errors, send them back, or discard them.

    A dead letter is a group that failed for good: engine or reward failures past
    the attempt limit, a malformed entry, a bad dataset row. IDs are stream entry
    ids (as `dead list` shows) or group ids.

    \b
    Example:
      rollout dead list
      rollout dead show 1712345678901-0
      rollout dead retry --all
      rollout dead drop data.jsonl:0:17
    """


@dead.command("list")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(min=0), help="Oldest N (0: all).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: {namespace, total, dead_letters}.")
@click.pass_obj
def dead_list(obj: Context, limit, as_json) -> None:
    """List dead letters, oldest first, with their errors.

    An error too long for the line keeps its first clause and its end (the
    last error), the informative parts: `engine failed 3 times; …503 from
    http://e:30000`.

    \b
    JSON keys (stable; docs/cli.md): namespace, total, dead_letters (entry_id,
    group_id, error, reason, age_s, retriable, not_retriable_because, bad_row,
    decode_error, payload_bytes, dataset, epoch, row, attempts, restarts,
    worker, n_samples, statuses).

    \b
    Example:
      rollout dead list --limit 20
    """
    from pipeline.ops import deadletters

    queue = obj.nonempty_queue(read_only=True)
    total = deadletters.count(queue)
    letters = deadletters.list_dead(queue, limit or None)
    if as_json:
        click.echo(dump({"namespace": obj.namespace, "total": total,
                          "dead_letters": [l.summary() for l in letters]}))
        return
    console = rich_console()
    if not letters:
        console.print(f"no dead letters in namespace {obj.namespace!r}", markup=False)
        return
    from pipeline.ops.printable import printable
    from pipeline.tables import column_widths, fitted_table

    rows = []
    for l in letters:
        g = l.group
        rows.append((printable(l.entry_id), printable(l.group_id), _age(l.age_s),
                     "-" if g is None else str(g.attempts), printable(l.category),
                     _retry_mark(l) + printable(l.error or "-")))
    # The error takes the room the other columns leave, on up to two lines (_two_lines).
    widths = column_widths(DEAD_COLUMNS, rows, console.width)
    rows = [(*r[:5], _two_lines(r[5], widths[5])) for r in rows]
    console.print(fitted_table(DEAD_COLUMNS, rows, widths))
    summary = deadletters.summarize(letters)
    shown = f"{len(letters)} of {total}" if total > len(letters) else f"{total}"
    reasons = ", ".join(f"{reason} {n}" for reason, n in summary.by_reason.items())
    console.print(f"{shown} dead letter{'' if total == 1 else 's'} ({reasons}); `rollout dead show ID` for one "
                  "in full", markup=False)


DEAD_COLUMNS = [Col("id"), Col("group", flex=True, min_width=10), Col("age", "right"), Col("try", "right"),
                Col("reason"), Col("error", flex=True, min_width=20)]


def _two_lines(error: str, width: int) -> str:
    """`error` on at most two lines of `width`, broken between words (a flag is never
    split). A longer one keeps what says most: its first clause ("engine failed 3 times;")
    on the first line when it fits there, and its end (the last error) after "…"."""
    import textwrap

    lines = textwrap.wrap(error, width, break_on_hyphens=False)
    if len(lines) <= 2:
        return "\n".join(lines)
    head = error.split("; ", 1)[0] + ";"
    if "; " in error and len(head) <= width:
        return head + "\n…" + _end(error, width - 1)
    budget = 2 * width - 1  # no short first clause: both lines for the end
    while True:
        lines = textwrap.wrap("…" + _end(error, budget), width, break_on_hyphens=False)
        if len(lines) <= 2:
            return "\n".join(lines)
        budget -= 2


def _end(text: str, n: int) -> str:
    """The last words of `text` in at most `n` characters; its last `n` characters when
    whole words would leave most of them empty (one long word)."""
    words: list[str] = []
    for word in reversed(text.split()):
        if len(" ".join([word, *words])) > n:
            break
        words.insert(0, word)
    joined = " ".join(words)
    return joined if len(joined) >= n // 2 else text[-n:]


def _retry_mark(letter) -> str:
    """Before the error: a letter no retry can help (the reason column says what it is)."""
    if letter.not_retriable:
        return "[cannot retry] "
    return "[fails again] " if letter.fails_again else ""


def _age(seconds) -> str:
    from pipeline.ops.status_render import age

    return age(seconds)


@dead.command("show")
@click.argument("ident", metavar="ID")
@click.option("--json", "as_json", is_flag=True, help="One JSON object with every field.")
@click.pass_obj
def dead_show(obj: Context, ident, as_json) -> None:
    """Show one dead letter in full: error, group, samples, raw row, and the
    group's history (which workers held it, and whether each was reaped or
    handed it back).

    \b
    JSON (one object per dead letter, one per line; stable, docs/cli.md): the
    keys of `dead list --json`'s dead_letters, and payload_head, prompt, label,
    admitted_version, created_at, claimed_at, finished_at, raw_row, samples
    (index, status, response_length, reward, weight_versions, response),
    history (at_ms, age_s, event, who, detail).

    \b
    Example:
      rollout dead show 1712345678901-0
      rollout dead show data.jsonl:0:17 --json
    """
    from pipeline.ops import deadletters
    from pipeline.ops.printable import printable

    queue = obj.nonempty_queue(read_only=True)
    letters, missing = deadletters.find(queue, [ident])
    if missing:
        raise click.ClickException(f"no dead letter {printable(ident)!r} in namespace {obj.namespace!r} "
                                   "(`rollout dead list` shows the ids)")
    now_ms = queue.now_ms()
    details = [l.details(queue.history(l.group_id), now_ms) for l in letters]
    if as_json:
        for d in details:
            click.echo(dump(d))
        return
    for l, d in zip(letters, details):
        lines = [f"dead letter {l.entry_id}", f"  group      {l.group_id}", f"  age        {_age(l.age_s)}",
                 f"  reason     {l.category}", f"  error      {l.error or '-'}"]
        if l.not_retriable:
            lines.append(f"  retry      no: {l.not_retriable}")
        elif l.fails_again:
            lines.append(f"  retry      not as it is: {l.fails_again}")
        elif l.bad_row:
            lines.append(f"  retry      after fixing the row in its file: rollout dead retry {l.entry_id}")
        else:
            lines.append(f"  retry      yes: rollout dead retry {l.entry_id}")
        if l.group is None:
            lines.append(f"  payload    {len(l.data)} bytes, does not decode: {l.decode_error}")
        else:
            g = l.group
            lines += [f"  dataset    {g.dataset or '-'} epoch {g.epoch} row {g.row}",
                      f"  attempts   {g.attempts}   restarts {g.restarts}   last worker {g.worker or '-'}",
                      f"  prompt     {str(d.get('prompt'))[:200]!s}"]
            if d.get("raw_row"):
                lines.append(f"  raw row    {d['raw_row'].strip()[:300]}")
            for s in d["samples"]:
                lines.append(f"  sample {s['index']}: {s['status']}, {s['response_length']} tokens, reward "
                             f"{s['reward']}, versions {','.join(s['weight_versions']) or '-'}")
        # Who held it, and how each let go of it: reaped (died holding it) or handed back.
        lines.append("  history" if d["history"] else "  history    none kept")
        for e in d["history"]:
            lines.append(f"    {_age(e['age_s']):>7} ago  {e['event']:<11} {e['who']}"
                         + (f"  {e['detail']}" if e["detail"] else ""))
        click.echo("\n".join(printable(line) for line in lines))  # every field may come from data


@dead.command("retry")
@click.argument("idents", nargs=-1, metavar="[ID]...")
@click.option("--all", "all_", is_flag=True, help="Every dead letter that can be retried.")
@click.option("--restart", is_flag=True, help="Also forget any generated output: generate from the prompt.")
@click.pass_obj
def dead_retry(obj: Context, idents, all_, restart) -> None:
    """Send dead letters back to the head of the prompt list.

    Their attempt counts are reset and their errors cleared. A bad dataset row is
    read again from its file (fix it there first). Undecodable payloads and rows
    still bad cannot be retried: given by id, nothing is done and the error names
    them; with --all they are skipped and listed.

    \b
    Example:
      rollout dead retry 1712345678901-0 1712345678950-0
      rollout dead retry --all --restart
    """
    from pipeline.ops import deadletters

    queue = obj.nonempty_queue()
    try:
        result = deadletters.retry(queue, list(idents), all_, restart)
    except deadletters.DeadLetterError as exc:
        raise click.ClickException(str(exc)) from None
    for letter, why in result.skipped:
        click.echo(f"skipped {letter.describe()}: {why}", err=True)
    for letter, why in result.doomed:
        click.echo(f"warning: retried {letter.describe()}, but {why}", err=True)
    click.echo(f"retried {counted(result.settled, 'dead letter')}: back at the head of the prompt list"
               + (f" ({len(result.skipped)} skipped)" if result.skipped else ""))


@dead.command("drop")
@click.argument("idents", nargs=-1, metavar="[ID]...")
@click.option("--all", "all_", is_flag=True, help="Every dead letter.")
@click.pass_obj
def dead_drop(obj: Context, idents, all_) -> None:
    """Discard dead letters for good (the audit counts them as discarded).

    \b
    Example:
      rollout dead drop 1712345678901-0
      rollout dead drop --all
    """
    from pipeline.ops import deadletters

    queue = obj.nonempty_queue()
    try:
        _letters, n = deadletters.drop(queue, list(idents), all_)
    except deadletters.DeadLetterError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"dropped {counted(n, 'dead letter')}")
