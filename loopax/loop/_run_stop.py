"""How a run ends before its last step: a stop asked for, a signal, or a stop agreed on."""

from __future__ import annotations

from ..trainer import Trainer
from ._hook import NEVER
from ._signals import Interrupts, exit_interrupted, signal_name
from ._stop_agreement import AgreedStop, StopAgreement


class RunStop:
    """A run's early stop: asked for (`request`), by SIGINT or SIGTERM, agreed by processes.

    One per `Runner`, which asks it between steps and at its settle points. On one process
    a stop asked for ends the run after the current step's hooks. On several, it is only
    proposed (`StopAgreement`): the steps stop at once to propose it, and every process
    goes on to the step they agree on, which this process reads at its settle points.

    Args:
      trainer: the trainer of the runs (its devices say whether processes must agree).
      margin: the steps a proposed stop lies ahead of the proposer's last step, past any
        process's first look at it.

    Attributes:
      requested: whether the run's steps end after the current step's hooks.
      reason: the reason of the stop that ends the run, or None.
      interrupted: whether SIGINT or SIGTERM stopped the run before its last step (on
        this process, or on the process whose stop every process agreed on); set before
        the OnEnd hooks (`end`), cleared when the next run starts (`start_run`).
      agreement: the run's `StopAgreement` on several processes; None on one, or between
        runs.
    """

    def __init__(self, trainer: Trainer, margin: int) -> None:
        self._trainer = trainer
        self._margin = margin
        self.requested = False
        self.reason: str | None = None
        self.interrupted = False
        self.agreement: StopAgreement | None = None
        self._adopted = False  # whether the run's steps go to the agreed stop already
        self._interrupts = Interrupts(self._on_signal)

    def request(self, reason: str, signum: int | None = None) -> None:
        """Ends the run after the current step's hooks; on several processes, proposes it."""
        if self.agreement is not None:
            if self.agreement.want(reason, signum):
                self.requested = True  # out of the steps, to propose the stop now
            return
        self.requested = True
        self.reason = reason

    def _on_signal(self, signum: int) -> None:
        self.request(f"interrupted by {signal_name(signum)}", signum)

    # -- a run's life ---------------------------------------------------------------------

    def open(self) -> Interrupts:
        """A run begins: its agreement (several processes); the signal handlers to hold."""
        self.agreement = StopAgreement.for_run(self._trainer, self._margin)
        self._adopted = False
        return self._interrupts

    def start_run(self) -> None:
        """The run's OnStart hooks are next: no stop asked yet."""
        self.requested = self.interrupted = False
        self.reason = None

    def end(self, loop_step: int, end_step: int) -> None:
        """The run ends at `loop_step` (its OnEnd hooks are next): sets `interrupted`.

        A signal counts when the run ends before its last step (`end_step`); on several
        processes the agreed stop decides, so every process answers alike.
        """
        if loop_step == end_step:
            self.interrupted = False  # the run is complete, whenever a signal came
        elif self.agreement is not None:
            agreed = self.agreement.agreed
            self.interrupted = agreed is not None and agreed.signum is not None
        else:
            self.interrupted = self._interrupts.received is not None

    def close(self) -> AgreedStop | None:
        """The run is over: ends its agreement, if any; the stop it agreed on."""
        agreement, self.agreement = self.agreement, None
        if agreement is None:
            return None
        agreed = agreement.agreed
        agreement.close()
        return agreed

    def exit_if_signaled(
        self, agreed: AgreedStop | None, loop_step: int, checkpointed_step: int | None
    ) -> None:
        """After a run: exits with one line when a signal stopped it, here or on another process.

        Args:
          agreed: the stop the run's processes agreed on (`close`), or None.
          loop_step: where the run ended.
          checkpointed_step: the newest global step a checkpoint saved, or None.
        """
        signum = self._interrupts.received
        if signum is None and agreed is not None and loop_step == agreed.step + 1:
            signum = agreed.signum  # the signal another process got: every process exits so
        if signum is not None:
            exit_interrupted(signum, self._trainer.global_step, checkpointed_step)

    # -- between steps ---------------------------------------------------------------------

    def poll(self, loop_step: int) -> None:
        """At a settle point: a stop another process proposed ends the steps, to go to it."""
        agreement = self.agreement
        if agreement is not None and not self._adopted and agreement.poll(loop_step):
            self.requested = True  # out of the steps, to go on to the agreed one

    def agreed_stop_step(self, step: int, stop_step: int) -> int:
        """`stop_step` brought to one past the agreed stop, if any; `step`: dispatched last."""
        agreement = self.agreement
        agreed = None if agreement is None else agreement.poll(step)
        if agreed is None:
            return stop_step
        if step > agreed.step:
            raise RuntimeError(
                f"process {agreed.process} asked every process to stop after step "
                f"{agreed.step} ({agreed.reason}), but this one had already run step {step}; "
                "the processes were further apart than their steps in flight allow (does "
                "every step hold a collective over the processes' devices?)"
            )
        self._adopted = True
        return min(stop_step, agreed.step + 1)

    def here(self, loop_step: int) -> bool:
        """Between steps: whether the run ends at `loop_step` (a stop was asked or agreed).

        On several processes only at the agreed step: it sets `reason` to the agreed
        reason, the same on every process.
        """
        agreement = self.agreement
        if agreement is None:
            return self.requested
        agreed = agreement.poll(loop_step)
        self.requested = False
        if agreed is not None and self.agreed_stop_step(loop_step - 1, NEVER) <= loop_step:
            self.requested = True
            self.reason = agreed.shown_reason
        return self.requested
