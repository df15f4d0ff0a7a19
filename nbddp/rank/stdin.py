"""In a rank: ``input()``, ``sys.stdin``, ``getpass`` and pdb read from the notebook's input box.

The rank sends ``InputRequest`` on its channel and waits for the kernel's ``InputReply`` on its
command pipe; the kernel asks the front end, one rank at a time, the prompt labelled with the rank
(kernel/cells/prompts.py). Where the front end has no input box (nbclient, papermill) the rank raises the
``StdinNotImplementedError`` a plain cell raises; an interrupt ends the wait with KeyboardInterrupt.
Spawned ranks have no command pipe: reading fails at once, saying why."""
from __future__ import annotations

import builtins
import getpass
import io
import itertools
import sys

from ..wire import messages

_link = None  # (commands.CommandPipe, the channel's framing.Writer), once the rank's server has them
_ids = itertools.count(1)


def install(pipe, chan) -> None:
    """``pipe``: the rank's CommandPipe, or None (spawned: no input box can be reached)."""
    global _link
    _link = (pipe, chan)
    sys.stdin = NotebookStdin()
    builtins.input = notebook_input
    getpass.getpass = notebook_getpass


def ask(prompt: str = "", password: bool = False) -> str:
    """One line from the notebook's input box (without its newline)."""
    from .stdio import flush_streams

    pipe, chan = _link if _link is not None else (None, None)
    if pipe is None:
        raise _stdin_error("this rank was started with --start-method spawn and has no command pipe, so it "
                           "cannot reach the notebook's input box; use the default fork start method.")
    rid = next(_ids)
    flush_streams()  # what the rank printed (pdb's listing) shows before the prompt
    chan.send(messages.InputRequest(rid, str(prompt), password))
    reply = pipe.until(lambda cmd: isinstance(cmd, messages.InputReply) and cmd.id == rid)
    if reply.error is not None:
        raise _raised(reply)
    return reply.value


def notebook_input(prompt="") -> str:
    return ask(str(prompt))


def notebook_getpass(prompt="Password: ", stream=None) -> str:
    return ask(prompt, password=True)


class NotebookStdin(io.TextIOBase):
    """``sys.stdin`` of a rank: each line read is asked for in the notebook."""

    encoding = "utf-8"

    def readable(self) -> bool:
        return True

    def readline(self, size=-1) -> str:
        return ask("") + "\n"

    def read(self, size=-1) -> str:
        return self.readline()

    def isatty(self) -> bool:
        return False


def _stdin_error(message: str) -> Exception:
    try:
        from IPython.core.error import StdinNotImplementedError
    except ImportError:  # a spawned rank outside IPython
        return NotImplementedError(message)
    return StdinNotImplementedError(message)


def _raised(reply: messages.InputReply) -> BaseException:
    if reply.error == "StdinNotImplementedError":
        return _stdin_error(reply.message)
    kind = {"KeyboardInterrupt": KeyboardInterrupt, "EOFError": EOFError}.get(reply.error)
    return kind(reply.message) if kind else RuntimeError(f"{reply.error}: {reply.message}")
