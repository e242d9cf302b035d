"""Drive an ES run from JupyterLab: Step / Run N / Pause / Save checkpoint buttons, a live fitness
plot and a table of the last generation's best and worst completions.

Generations run in a background thread, so the kernel stays responsive and Pause can be clicked;
Pause sets a flag that `ESRun.run` checks between generations (a generation is never cut in half).
"""
from __future__ import annotations

import html
import threading
import traceback
from pathlib import Path
from typing import Any

import ipywidgets as widgets

from ..metrics import completions_table
from . import plots
from .labels import model_title
from .live import LivePlot, live_fitness_plot


class ESStepper:
    """Widgets around an `ESRun` (or anything with step/run/save_checkpoint/history/generation)."""

    def __init__(self, run: Any, plot: LivePlot | None = None, run_count: int = 5, max_chars: int = 160,
                 figures_dir: str | Path | None = None, figure_name: str = "es_stepper_fitness"):
        self.run = run
        reward_label = getattr(getattr(run, "task", None), "reward_label", None)  # the task's reward, in words
        self.reward_label = reward_label
        config = getattr(run, "config", None)
        # "ES on conciseness (smollm2-135m-instruct)"; tiny-random's title says its rewards mean nothing
        self.title = (model_title(f"ES on {config.task}", config.model) if hasattr(config, "model")
                      else "ES fitness")
        self.plot = plot if plot is not None else live_fitness_plot(self.title, reward_label=reward_label)
        self.figures_dir = figures_dir
        """With a folder, the fitness figure is exported there again after every Step or Run N (the files follow the run)."""
        self.figure_name = figure_name
        self.figure_paths: list[Path] = []
        self.max_chars = max_chars
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._busy = threading.Lock()  # held while generations run: a second click is ignored
        self._thread: threading.Thread | None = None
        self._state = "idle"

        self.step_button = widgets.Button(description="Step", icon="step-forward", tooltip="run one generation")
        self.run_button = widgets.Button(description="Run N", icon="play", tooltip="run N more generations")
        self.count = widgets.IntText(value=run_count, description="N", layout=widgets.Layout(width="120px"))
        self.pause_button = widgets.Button(description="Pause", icon="pause", disabled=True,
                                           tooltip="stop after the current generation")
        self.save_button = widgets.Button(description="Save checkpoint", icon="save")
        self.status = widgets.HTML()
        self.table = widgets.HTML()
        self.step_button.on_click(lambda _: self.start(1))
        self.run_button.on_click(lambda _: self.start(self.count.value))
        self.pause_button.on_click(lambda _: self.pause())
        self.save_button.on_click(lambda _: self.save_checkpoint())
        controls = widgets.HBox([self.step_button, self.run_button, self.count, self.pause_button, self.save_button])
        self.box = widgets.VBox([controls, self.status, self.plot.widget, self.table])
        self.refresh()

    # --- actions ---------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """True while a background thread is running generations."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, count: int) -> bool:
        """Run ``count`` more generations in a background thread; False if already running."""
        if count < 1 or not self._busy.acquire(blocking=False):
            return False
        self._stop.clear()
        self.error = None
        self._set_buttons(running=True)
        self._state = f"running {count} generation{'s' if count != 1 else ''}"
        self._update_status()
        target = self.run.generation + int(count)
        self._thread = threading.Thread(target=self._work, args=(target,), name="es-stepper", daemon=True)
        self._thread.start()
        return True

    def _work(self, target: int) -> None:
        try:
            self.run.run(target, callback=lambda _row: self.refresh(), should_stop=self._stop.is_set)
            self._state = "paused" if self._stop.is_set() and self.run.generation < target else "idle"
        except BaseException as error:  # noqa: BLE001 - shown in the widget, not lost in a thread
            self.error = error
            self._state = f"error: {type(error).__name__}: {error}"
            traceback.print_exc()
        finally:
            self._export_after_steps()
            self._busy.release()
            self._set_buttons(running=False)
            self.refresh()

    def pause(self) -> None:
        """Stop after the generation in progress."""
        if self.running:
            self._stop.set()
            self._state = "pausing after this generation"
            self._update_status()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the background generations finish (for scripts and tests)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def show(self, row: dict, echo: bool = True) -> None:
        """Redraw the plot and table after a generation committed outside the buttons (the notebook's
        loop); with ``echo`` one line for it is printed."""
        self.refresh()
        if echo:
            print(f"generation {row['generation']:3d}  reward mean {row['train/reward_mean']:8.3f}  "
                  f"best {row['train/reward_best']:8.3f}  update norm {row['es/update_norm']:.4f}  "
                  f"{row.get('time/generation_s', 0.0):.1f} s", flush=True)

    def export_figure(self) -> list[Path]:
        """The fitness figure of the run so far as PNG, PDF and SVG in ``figures_dir`` (the paths)."""
        from .figures import export_figure

        if self.figures_dir is None:
            raise ValueError("no figures_dir: pass ESStepper(run, figures_dir=...) to export the figure")
        figure = plots.plot_fitness(self.run.history, title=self.title, reward_label=self.reward_label)
        self.figure_paths = export_figure(figure, self.figure_name, self.figures_dir)
        return self.figure_paths

    def _export_after_steps(self) -> None:
        if self.figures_dir is None:
            return
        try:
            self.export_figure()
        except Exception as error:  # noqa: BLE001 - the generations stand; say the files are behind
            self._state += f" (figure not exported: {type(error).__name__}: {error})"

    def save_checkpoint(self):
        """Write a checkpoint of the current generation now."""
        path = self.run.save_checkpoint()
        self._state = f"checkpoint saved: {path}"
        self._update_status()
        return path

    # --- display ---------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Redraw the fitness plot, the completions table and the status line from ``run.history``."""
        history = list(self.run.history)
        self.plot.update(history)
        self.table.value = self._table_html(history)
        self._update_status()

    def _update_status(self) -> None:
        history = list(self.run.history)
        parts = [f"<b>generation {self.run.generation}</b>", self._state]
        last = next((r for r in reversed(history) if "train/reward_mean" in r), None)
        if last is not None:
            parts.append(f"population mean {last['train/reward_mean']:.3f}, best {last['train/reward_best']:.3f}")
        scored = next((r for r in reversed(history) if "eval/reward" in r), None)
        if scored is not None:
            parts.append(f"mean adapter: train {scored['policy/train_reward']:.3f}, eval {scored['eval/reward']:.3f}")
        self.status.value = " &middot; ".join(html.escape(p) if not p.startswith("<b>") else p for p in parts)

    def _table_html(self, history: list[dict]) -> str:
        last = next((r for r in reversed(history) if r.get("best_completions")), None)
        if last is None:
            return "<i>no generation yet: best and worst completions appear here</i>"
        rows = self._completion_rows(last)
        table = completions_table(rows, max_chars=self.max_chars).to_html(index=False, escape=True)
        title = (f"generation {last['generation']}: best member {last['train/reward_best']:.3f}, "
                 f"worst {last['train/reward_worst']:.3f}")
        return f"<b>{html.escape(title)}</b>{table}"

    def _completion_rows(self, row: dict) -> list[dict]:
        """One line per prompt of a generation: the prompt, its target, and the best and worst member's
        completion each with its reward (the task's reward of that completion for that prompt)."""
        examples = {example.prompt: example for example in getattr(self.run, "train_examples", ())}
        found = [(prompt, best, worst, examples.get(prompt)) for prompt, best, worst in
                 zip(row.get("prompts", []), row["best_completions"], row.get("worst_completions", []))]
        known = [example for *_, example in found if example is not None]
        reward = self.run.task.reward_fn if known else None
        best_rewards = iter(reward([b for _, b, _, e in found if e is not None], known) if known else [])
        worst_rewards = iter(reward([w for _, _, w, e in found if e is not None], known) if known else [])
        lines = []
        for prompt, best, worst, example in found:
            scored = example is not None
            lines.append({"prompt": prompt, "target": example.target if scored else "",
                          "best member": best, "best reward": next(best_rewards) if scored else None,
                          "worst member": worst, "worst reward": next(worst_rewards) if scored else None})
        return lines

    def _set_buttons(self, running: bool) -> None:
        for button in (self.step_button, self.run_button, self.save_button):
            button.disabled = running
        self.count.disabled = running
        self.pause_button.disabled = not running

    def display(self) -> None:
        """Show the widgets in the notebook."""
        from IPython.display import display

        display(self.box)

    def _repr_mimebundle_(self, **kwargs):
        return self.box._repr_mimebundle_(**kwargs)
