"""The bridge's link to physis-serve: the ``LinkClient``, the stream it follows, and the
thread that takes its predictions.

Nothing here waits in the node's constructor. With ``server_port_file`` the client is made
once the server has written its port there (``try_start``, polled by the node's timer; the
link says ``waiting for port file ...`` in /diagnostics until then), else at once. With
``task_topic`` the client connects and learns the model's contract, and opens the stream
once the first task's values are set (``set_task``). Predictions go to ``on_prediction`` on
the link's own receive thread. A model whose inputs the robot's topics cannot give refuses
the stream (``refuse``).

An outage ends when predictions come again on a new connection after a link error
(``arrived``): the link says so in one log line with the outage's length, and the error is
history (``LinkRecovery``), no longer the link's ``last_error``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from physis_ros.contract.model import WamContract
from physis_ros.link.client import (
    LinkClient,
    LinkPromise,
    LinkStats,
    Observation,
    Prediction,
)
from physis_ros.link.options import ROLLOUT_CHOICES
from physis_ros.nodes.bridge_params import BridgeParams

SERVER_PORT_WAIT_S = 600.0
"""Longest the bridge waits for physis-serve's --port-file: the server writes it once it has
loaded the model and measured its engine, which takes minutes for a large model on a loaded
machine."""

PORT_POLL_S = 0.05
"""How often the port file is looked for."""

RECEIVE_POLL_S = 0.05
"""Longest the receive thread waits for a prediction before it looks whether to stop."""


def read_port(path: str) -> int | None:
    """The port physis-serve --port-file wrote to ``path``; None while there is none."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    return int(text) if text else None


@dataclass(frozen=True, kw_only=True)
class LinkRecovery:
    """The newest outage the link came back from."""

    at_ns: int
    """Robot clock when predictions came again."""
    outage_s: float
    """From the last prediction before it (or the link's start) to the first after it."""
    error: str
    """The link's last error before it came back."""
    error_ns: int
    count: int
    """Outages so far."""


class BridgeLink:
    """The node's one link client and its receive thread (see the module docstring)."""

    def __init__(
        self,
        p: BridgeParams,
        *,
        client: LinkClient | None = None,
        client_name: str,
        clock_ns: Callable[[], int],
        on_prediction: Callable[[Prediction], None],
        logger,
    ) -> None:
        self.p = p
        self._client_name, self._clock_ns = client_name, clock_ns
        self._on_prediction = on_prediction
        self._logger = logger
        self._task: dict[str, float] = {}
        self.refused = ""
        """Why the model cannot be fed from this robot's topics ("" while it can)."""
        self._token = p.token or None
        if p.token_file:  # read now: a missing file fails the node at start
            with open(p.token_file) as f:
                self._token = f.read().strip()
        self._client = client
        if client is None and not p.server_port_file:
            self._client = self._make_client(p.server)
        self._stream_wanted = False
        self._started = False
        self._port_deadline_s = time.monotonic() + SERVER_PORT_WAIT_S
        self._stop = threading.Event()
        self._receiver = threading.Thread(
            target=self._receive_loop, name="bridge-receive", daemon=True
        )
        self.promise: LinkPromise | None = None
        """The stream's promise as last refreshed (``refresh_promise``, ``poll``)."""
        self._stream_id: int | None = None
        self._error_logged = ""
        self._started_ns = 0
        self._last_arrival: tuple[int, int] | None = None
        """(robot clock ns, the link's connection count) of the newest prediction."""
        self.recovery: LinkRecovery | None = None
        """The newest outage the link came back from (None: none yet)."""

    def _make_client(self, target: str) -> LinkClient:
        p = self.p
        return LinkClient(
            target,
            seed=p.seed,
            prompt=p.prompt,
            task=self._task,
            target_interval_ms=p.target_interval_ms,
            response_latency_budget_ms=p.response_latency_budget_ms,
            previews=p.previews or p.act_on_previews,
            horizon=p.horizon,
            rollouts=ROLLOUT_CHOICES[p.rollouts],
            token=self._token,
            root_cert_path=p.root_cert_path or None,
            client_cert_path=p.client_cert_path or None,
            client_key_path=p.client_key_path or None,
            connect_timeout_s=p.connect_timeout_s,
            client_name=self._client_name,
            clock_ns=self._clock_ns,
        )

    # ---- starting: the node's thread -----------------------------------------------------

    def waiting(self) -> str:
        """What the link waits for before it has a client ("": nothing)."""
        if self._client is None:
            return f"waiting for port file {self.p.server_port_file}"
        return ""

    def try_start(self) -> bool:
        """Starts the receive thread (and the stream, if wanted) once there is a client; True
        once started. Without one, looks for the server's port once and makes it from there;
        past SERVER_PORT_WAIT_S without a port: TimeoutError (the node cannot work)."""
        if self._started:
            return True
        if self._client is None:
            port = read_port(self.p.server_port_file)
            if port is None:
                if time.monotonic() > self._port_deadline_s:
                    raise TimeoutError(
                        f"no port in {self.p.server_port_file} after {SERVER_PORT_WAIT_S} s"
                    )
                return False
            target = f"{self.p.server.rsplit(':', 1)[0]}:{port}"
            self._logger.info(f"server at {target} (from {self.p.server_port_file})")
            self._client = self._make_client(target)
        self._started = True
        self._started_ns = self._clock_ns()
        if self._stream_wanted:
            self._client.start()
        self._receiver.start()
        return True

    def set_task(self, task: dict[str, float]) -> None:
        """Streams open with the task's values ``task`` from now on (the open one is
        reopened with them)."""
        self._task = task
        if self._client is not None:
            self._client.set_task(task)

    def contract(self) -> WamContract | None:
        """The served model's contract, once the link has reached the server (None before,
        or for a world model)."""
        return self._client.contract if self._client is not None else None

    def refuse(self, why: str) -> None:
        """The model cannot be fed from this robot's topics: the stream is closed and stays
        closed (``refused`` says why, on /diagnostics)."""
        self.refused = why
        self._stream_wanted = False
        if self._client is not None:
            self._client.close(timeout_s=2.0)

    def open_stream(self) -> None:
        """The stream opens now, or as soon as the link starts (again: no-op)."""
        if self.refused:
            return
        self._stream_wanted = True
        if self._started:
            self._client.start()

    # ---- the stream ------------------------------------------------------------------------

    def send(self, obs: Observation) -> bool:
        """Hands ``obs`` to the client (non-blocking: newest wins inside it); False when there
        is no client yet."""
        client = self._client
        if client is None:
            return False
        client.send_observation(obs)
        return True

    def stats(self) -> LinkStats:
        """The client's stats, less an error the link has come back from."""
        client = self._client
        if client is not None:
            link = client.stats()
            recovered = self.recovery
            if link.last_error and recovered and link.last_error_ns <= recovered.error_ns:
                return dataclasses.replace(link, last_error="")
            return link
        return LinkStats(
            state="disconnected",
            promise=None,
            clock_offset_ms=None,
            clock_offset_uncertainty_ms=None,
            robot_time_ns=self._clock_ns(),
            server_time_ns=None,
            observations_sent=0,
        )

    def refresh_promise(self) -> LinkPromise | None:
        """The promise of the stream now (None before it opens), kept as ``promise``."""
        self.promise = self.stats().promise
        return self.promise

    def current_promise(self) -> LinkPromise | None:
        """``promise``, refreshed while there is none."""
        return self.promise if self.promise is not None else self.refresh_promise()

    def poll(self) -> LinkStats:
        """The link's stats now; refreshes ``promise`` and says a new link error once (a
        refusal is not silent)."""
        link = self.stats()
        self.promise = link.promise
        if link.last_error != self._error_logged:
            if link.last_error:
                self._logger.warning(f"link: {link.last_error}")
            self._error_logged = link.last_error
        return link

    def follow_stream(self, stream_id: int) -> bool:
        """True when a prediction comes from a new stream (a server restart, a new prompt):
        it numbers its chunks afresh, and its promise is taken."""
        if stream_id == self._stream_id:
            return False
        self._stream_id = stream_id
        self.refresh_promise()
        return True

    def arrived(self, received_ns: int) -> bool:
        """A prediction came (receive thread), at robot clock ``received_ns``. True when it
        ends an outage: the first prediction of a new connection, with a link error since
        the previous prediction (or since the start). Said in one log line."""
        link = self._client.stats()
        previous = self._last_arrival
        self._last_arrival = (received_ns, link.connections)
        since_ns = previous[0] if previous is not None else self._started_ns
        if previous is not None and previous[1] == link.connections:
            return False  # the same connection
        if not link.last_error or link.last_error_ns <= since_ns:
            return False  # a new stream on purpose (a new prompt), or the first one
        count = self.recovery.count + 1 if self.recovery is not None else 1
        self.recovery = LinkRecovery(
            at_ns=received_ns,
            outage_s=(received_ns - since_ns) / 1e9,
            error=link.last_error,
            error_ns=link.last_error_ns,
            count=count,
        )
        if previous is not None:
            what = f"streaming again after a {self.recovery.outage_s:.1f} s outage"
        else:
            what = f"streaming, {self.recovery.outage_s:.1f} s after the link started"
        self._logger.info(f"link: {what} (last error: {link.last_error})")
        return True

    def _receive_loop(self) -> None:
        client = self._client
        while not self._stop.is_set():
            prediction = client.get_prediction(timeout_s=RECEIVE_POLL_S)
            if prediction is not None:
                self._on_prediction(prediction)

    def stop_receiving(self) -> None:
        """No prediction is handed on after this returns (the one being handed on is done)."""
        self._stop.set()
        if self._started:
            self._receiver.join(timeout=2.0)

    def close(self) -> None:
        self.stop_receiving()
        if self._client is not None:
            self._client.close()
