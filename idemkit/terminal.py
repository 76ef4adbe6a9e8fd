"""An interactive shell in a pseudo-terminal, the way a user's terminal runs one, for pasting the
docs' shell blocks into it whole: `bash --norc -i` and `zsh -f -i` (macOS's default shell, with
none of a user's settings: no `interactivecomments`, so there `#` starts no comment).

A block reaches the shell in one of the two ways a paste does:

- typed: the bytes as they are, Enter after each line, as `tmux send-keys` or a terminal without
  bracketed paste delivers them; the shell runs each line as it reads it;
- bracketed: wrapped in ESC[200~ ... ESC[201~, as a terminal pastes once the shell asked for it
  (ESC[?2004h, which bash >= 5.1 and zsh >= 5.1 send with every prompt); the shell puts the whole
  block into its line editor and runs it when the user presses Enter.

What the terminal showed is kept, and `text()` gives it without escape sequences.

    with Terminal("zsh") as term:
        term.paste(block, bracketed=False)
        term.type('echo "done $((6*7))"\\n')
        term.wait_for(r"done 42")
        print(term.text())
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path

SHELLS = {
    "bash": ["bash", "--norc", "--noprofile", "-i"],
    "zsh": ["zsh", "-f", "-i"],
}
PASTE_MODES = ("typed", "bracketed")

BRACKETED_PASTE_ON = b"\x1b[?2004h"
_ESCAPES = re.compile(
    rb"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI: colours, cursor moves, modes
    rb"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)"  # OSC: window titles
    rb"|\x1b[()][0-9A-Za-z]|\x1b[=>78M]"  # charsets, keypad, cursor save/restore, reverse index
)
_TAKE_TTY_AND_EXEC = ("import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
                      "os.execvp(sys.argv[1], sys.argv[1:])")
# Shell error messages: "bash: x: command not found", "zsh: no matches found: ...".
SHELL_ERROR = re.compile(r"^(?:bash|zsh): .*$", re.M)


def clean(raw: bytes) -> str:
    """What the terminal shows, as text: escape sequences gone, a character the line editor
    overwrote with a backspace gone, CR LF (and zsh's CR before a redrawn line) as LF."""
    text = _ESCAPES.sub(b"", raw).decode("utf-8", "replace")
    while True:
        text, n = re.subn(r"[^\x08\n]\x08", "", text)
        if not n:
            break
    # A line ends in CR LF, and in CR CR LF where the program wrote CR LF itself (curl's headers:
    # the terminal adds its CR to every LF).
    return re.sub(r"\r+\n", "\n", text.replace("\x08", "")).replace("\r", "\n")


class Terminal:
    """`shell` ("bash" or "zsh", or an argv) in a fresh pseudo-terminal of `columns` x `rows`,
    in its own session with the terminal as its controlling terminal (job control works as in
    a terminal window). Its HOME is an empty temporary directory (no history file, no startup
    file of the machine's user); `env` adds variables to PATH, TERM, LANG and HOME."""

    def __init__(self, shell: str | list[str], env: dict[str, str] | None = None,
                 cwd: Path | str | None = None, columns: int = 200, rows: int = 50) -> None:
        self.argv = list(SHELLS[shell]) if isinstance(shell, str) else list(shell)
        self.name = self.argv[0]
        self._home = tempfile.TemporaryDirectory(prefix="terminal-home-")
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "TERM": "xterm-256color",
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            "HOME": self._home.name,
            **(env or {}),
        }
        self.cwd = str(cwd) if cwd is not None else self._home.name
        self.columns, self.rows = columns, rows
        self.proc: subprocess.Popen | None = None
        self._master = -1
        self._raw = bytearray()
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None

    # ---- life cycle -----------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> "Terminal":
        """Start the shell and wait for its first prompt (the line editor asking for bracketed
        paste: both shells do it at every prompt)."""
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", self.rows, self.columns, 0, 0))
        try:
            # In a new session, the pty becomes its controlling terminal (as in a terminal window)
            # before the shell replaces this small Python: no preexec_fn in a threaded process.
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _TAKE_TTY_AND_EXEC, *self.argv],
                stdin=slave, stdout=slave, stderr=slave, env=self.env, cwd=self.cwd,
                start_new_session=True,
            )
        finally:
            os.close(slave)
        self._master = master
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.wait_raw(BRACKETED_PASTE_ON, timeout, "the first prompt of %s" % " ".join(self.argv))
        return self

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self._master, 65536)
            except OSError:  # EIO: the shell is gone and the pty closed
                return
            if not data:
                return
            with self._lock:
                self._raw.extend(data)

    def close(self, timeout: float = 5.0) -> int | None:
        """`exit`, and if the shell does not go within `timeout`, SIGKILL to its process group
        (the shell and whatever it still runs: it is the group's leader)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                # Ctrl-C first, which ends a continuation prompt (quote>) too; `exit` at the
                # prompt it gives back (typed before it, the line editor would lose a key).
                prompts = self.raw().count(BRACKETED_PASTE_ON)
                self.type("\x03")
                deadline = time.monotonic() + timeout
                while self.raw().count(BRACKETED_PASTE_ON) == prompts and time.monotonic() < deadline:
                    time.sleep(0.01)
                self.type("exit 0\n")
                self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout)
        if self._reader is not None:
            self._reader.join(timeout)
        if self._master >= 0:
            os.close(self._master)
            self._master = -1
        self._home.cleanup()
        return self.proc.returncode

    def __enter__(self) -> "Terminal":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- input ----------------------------------------------------------------------------

    def type(self, text: str) -> None:
        """Keys as a user types them: each newline is the Enter key (CR, what a terminal sends)."""
        self._write(text.replace("\n", "\r").encode())

    def paste(self, text: str, bracketed: bool) -> None:
        """`text` pasted whole. Bracketed: as a terminal pastes for a shell that asked for it, and
        then Enter, which runs what the paste put into the line editor; otherwise typed."""
        if bracketed:
            self._write(b"\x1b[200~" + text.replace("\n", "\r").encode() + b"\x1b[201~")
            self.type("\n")
        else:
            self.type(text)

    def paste_block(self, block: str, bracketed: bool, timeout: float = 30.0) -> str:
        """`block` pasted whole, then a line typed after it that prints a marker: what the
        terminal showed from the paste until the marker (the block's own output among it). A
        block the shell never finishes (a quote it left open swallows the marker line) fails
        after `timeout` seconds with the text so far."""
        start = len(self.raw())
        self.paste(block if block.endswith("\n") else block + "\n", bracketed)
        # $((6*7)): the line's echo does not hold the marker its output holds.
        self.type('echo "end of the paste: $((6*7))"\n')
        deadline = time.monotonic() + timeout
        while "end of the paste: 42\n" not in clean(self.raw()[start:]):
            self._check(deadline, "end of the pasted block (a quote left open?)")
        shown = clean(self.raw()[start:])
        return shown[:shown.index("end of the paste: 42\n")]

    def _write(self, data: bytes) -> None:
        # The reader thread drains the output meanwhile: a long paste cannot stall on a full pty.
        view = memoryview(data)
        while view:
            n = os.write(self._master, view[:512])
            view = view[n:]

    # ---- output ---------------------------------------------------------------------------

    def raw(self) -> bytes:
        with self._lock:
            return bytes(self._raw)

    def text(self) -> str:
        """Everything the terminal showed so far, as text (`clean`)."""
        return clean(self.raw())

    def wait_raw(self, needle: bytes, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.raw():
            self._check(deadline, what)

    def wait_for(self, pattern: str, timeout: float = 30.0) -> re.Match:
        """The first match of `pattern` (multiline) in the text; fails after `timeout` seconds
        with the text so far."""
        regex = re.compile(pattern, re.M)
        deadline = time.monotonic() + timeout
        while True:
            m = regex.search(self.text())
            if m:
                return m
            self._check(deadline, "/%s/" % pattern)

    def _check(self, deadline: float, what: str) -> None:
        if time.monotonic() >= deadline:
            raise AssertionError("%s: no %s within the time allowed; the terminal showed:\n%s"
                                 % (" ".join(self.argv), what, self.text()))
        if self.proc is not None and self.proc.poll() is not None and (
                self._reader is None or not self._reader.is_alive()):
            raise AssertionError("%s exited (%s) before %s; the terminal showed:\n%s"
                                 % (" ".join(self.argv), self.proc.returncode, what, self.text()))
        time.sleep(0.02)

    def errors(self) -> list[str]:
        """The shell's own error lines ("zsh: command not found: #", "bash: ...")."""
        return SHELL_ERROR.findall(self.text())
