"""The open-descriptor limit a serving command starts with: the soft limit raised to the hard one.

Most systems give a user's processes a soft limit of 1,024 and a hard one far above; a member's
API connections, its ring and the files a re-plan opens all count against the soft one, which a
process may raise to the hard one by itself. The API's connection cap is fitted under whatever the
limit is after this (kafila.api.overload.ApiLimits.fitted).
"""

from __future__ import annotations

from kafila.obs.log import get_logger

log = get_logger("kafila.cli")

# tried in turn where the hard limit is unlimited (Linux refuses more than fs.nr_open, macOS more
# than its OPEN_MAX)
UNLIMITED_TRIES = (1 << 20, 1 << 16, 10240)


def raise_descriptor_limit() -> tuple[int, int] | None:
    """Raise the soft RLIMIT_NOFILE to the hard one (or as near as the system takes) and log the
    values once, at debug level: a command's first lines are its progress ("kafila: session
    code: ...", which scripts read); the API's `api_listening` event says the limit in force.
    (soft, hard) after, or None where there is no such limit (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    before, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = UNLIMITED_TRIES if hard == resource.RLIM_INFINITY else (hard,)
    soft = before
    for target in wanted:
        if before != resource.RLIM_INFINITY and target <= before:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            continue
        soft = target
        break
    log.debug("descriptor_limit", soft_before=_shown(before), soft=_shown(soft), hard=_shown(hard))
    return soft, hard


def _shown(value: int) -> int | str:
    import resource

    return "unlimited" if value == resource.RLIM_INFINITY else value
