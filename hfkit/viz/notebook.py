"""The first cell of every notebook: `setup_notebook()` reads the profile, names the device and versions,
and sets the plotly renderer the notebooks and their HTML reports share.

The renderer (`report_renderer()`, registered as "hfkit_report") gives each figure two representations:
plotly's own mime type, which JupyterLab and VS Code draw natively, and an HTML `<div>` for exported
reports that expects `Plotly` to be loaded once per page. `setup_notebook` emits that one loader: a
`<script src="plotly.min.js">` by relative path, so every HTML report in a folder shares one copy of
plotly.js (`make report` copies `plotly_js_path()` into `reports/`) instead of embedding 4.8 MB each.

The profile is `smoke` (small sizes: CI, CPUs) or `full` (real sizes, GPUs). Triton's interpreter is
not switched on here: kernels read `TRITON_INTERPRET` when they are defined, so it comes from the
environment the kernel was started in (`make test`/`make report` set it where no GPU exists); without
it a CPU notebook runs each op's plain-torch reference, the documented CPU fallback.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd
    import torch

__all__ = [
    "PROFILES",
    "REPORT_RENDERER",
    "NotebookResults",
    "NotebookSettings",
    "plotly_js_path",
    "plotly_loader_html",
    "render_into",
    "report_renderer",
    "resolve_profile",
    "setup_notebook",
    "show_static_then_widget",
    "use_report_renderer",
]

PROFILES = ("smoke", "full")
REPORT_RENDERER = "hfkit_report"
PLOTLY_JS = "plotly.min.js"


@dataclass
class NotebookResults:
    """Benchmark rows a notebook section shows: `frame` (None when there are none), `label` (where and
    when they were measured, for titles) and `notes` (what was skipped, which files were loaded, or
    how to make results that are missing)."""

    frame: pd.DataFrame | None
    label: str | None
    notes: list[str] = field(default_factory=list)

    @property
    def failed(self) -> pd.DataFrame | None:
        """The rows that kept an error instead of a time (out of memory, an unsupported shape)."""
        if self.frame is None or "error" not in self.frame:
            return None
        failed = self.frame[self.frame["error"].notna()]
        return failed[[c for c in ("op", "case", "dtype", "mode", "provider", "error") if c in failed]]


@dataclass(frozen=True)
class NotebookSettings:
    """What a notebook runs with: the profile ("smoke" or "full"), the torch device and its name, the
    number of GPUs, whether Triton kernels run under the interpreter, and the library versions."""

    profile: str
    device: torch.device
    device_name: str
    gpu_count: int
    triton_interpret: bool
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def smoke(self) -> bool:
        """True in the smoke profile (small sizes)."""
        return self.profile == "smoke"

    @property
    def has_gpu(self) -> bool:
        """True where the notebook runs on a CUDA device."""
        return self.device.type == "cuda"

    @property
    def where(self) -> str:
        """A label for figure titles: the GPU's name, or on a CPU a reminder that times are CPU times
        (and, in the smoke profile, of small sizes)."""
        if self.has_gpu:
            return self.device_name
        return f"{self.device_name}: CPU times" + (", small sizes (smoke profile)" if self.smoke else "")

    @property
    def kernels(self) -> str:
        """How hfkit's fused ops run here: compiled Triton kernels, interpreted ones, or plain torch."""
        if self.has_gpu:
            return "Triton kernels compiled for the GPU"
        if self.triton_interpret:
            return "Triton kernels interpreted on the CPU (TRITON_INTERPRET=1)"
        return "ops run their plain-torch references (no GPU, TRITON_INTERPRET is not 1)"

    def summary(self) -> str:
        """Two lines: profile, device (with GPU and CPU counts) and how the ops run; then the versions."""
        gpus = f" ×{self.gpu_count}" if self.gpu_count > 1 else ""
        versions = "   ".join(f"{k} {v}" for k, v in self.versions.items())
        return (
            f"profile: {self.profile}   device: {self.device} ({self.device_name}{gpus}, "
            f"{os.cpu_count()} CPU cores)   {self.kernels}\n{versions}"
        )


def resolve_profile(profile: str | None, has_gpu: bool) -> str:
    """The profile to use: `profile` if given, else `HFKIT_PROFILE`, else "full" with a GPU and "smoke"
    without. Raises ValueError naming the setting when it is not "smoke" or "full"."""
    source = "profile"
    if profile is None:
        profile, source = os.environ.get("HFKIT_PROFILE"), "HFKIT_PROFILE"
    if profile is None or profile == "":
        return "full" if has_gpu else "smoke"
    if profile not in PROFILES:
        raise ValueError(f"{source}: expected one of {PROFILES}, got {profile!r}")
    return profile


def _installed_version(name: str) -> str:
    # Read from the installed distribution's metadata, not by importing: importing triton fixes, for the
    # whole process, whether its library functions are interpreted (TRITON_INTERPRET at that moment).
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _versions() -> dict[str, str]:
    import torch

    return {
        "hfkit": _installed_version("hfkit"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "triton": _installed_version("triton"),
        "plotly": _installed_version("plotly"),
    }


def plotly_js_path() -> Path:
    """The plotly.js bundle that ships with the plotly package (what HTML reports load once per folder)."""
    import plotly

    path = Path(plotly.__file__).parent / "package_data" / PLOTLY_JS
    if not path.is_file():
        raise FileNotFoundError(f"plotly: expected its bundled {PLOTLY_JS} at {path}, found none")
    return path


def plotly_loader_html() -> str:
    """The HTML that loads plotly.js once per page from `plotly.min.js` beside the report;
    figures rendered by `report_renderer()` draw with it."""
    return (
        "<script>window.PlotlyConfig = {MathJaxConfig: 'local'};</script>\n"
        f'<script charset="utf-8" src="{PLOTLY_JS}"></script>'
    )


def report_renderer() -> Any:
    """A plotly renderer (a `MimetypeRenderer`) that emits plotly's mime bundle, drawn natively by
    JupyterLab and VS Code, and an HTML `<div>` that draws with a page-wide `Plotly` (see
    `plotly_loader_html`), never embedding plotly.js itself."""
    from plotly.io import to_html
    from plotly.io._base_renderers import MimetypeRenderer, PlotlyRenderer

    class ReportRenderer(MimetypeRenderer):
        def to_mimebundle(self, fig_dict: dict[str, Any]) -> dict[str, Any]:
            bundle = PlotlyRenderer().to_mimebundle(dict(fig_dict))
            bundle["text/html"] = to_html(
                fig_dict,
                include_plotlyjs=False,
                include_mathjax=False,
                full_html=False,
                default_width="100%",
                default_height=525,
                validate=False,
            )
            return bundle

    return ReportRenderer()


def use_report_renderer() -> None:
    """Register `report_renderer()` as "hfkit_report" and make it plotly's default renderer."""
    import plotly.io as pio

    pio.renderers[REPORT_RENDERER] = report_renderer()
    pio.renderers.default = REPORT_RENDERER


def setup_notebook(profile: str | None = None, show: bool = True) -> NotebookSettings:
    """Set up a notebook: resolve the profile (`resolve_profile`), the device (the current GPU, else the
    CPU), the versions, and plotly's renderer (`use_report_renderer`); with `show`, print the summary
    and display the plotly.js loader for the HTML report. Returns the `NotebookSettings`.

    Environment variables are read, never written: `TRITON_INTERPRET` is whatever the kernel started
    with.
    """
    import torch

    from hfkit.bench import device_name, resolve_device

    device = resolve_device()
    settings = NotebookSettings(
        profile=resolve_profile(profile, device.type == "cuda"),
        device=device,
        device_name=device_name(device),
        gpu_count=torch.cuda.device_count() if device.type == "cuda" else 0,
        triton_interpret=os.environ.get("TRITON_INTERPRET", "0") == "1",
        versions=_versions(),
    )
    use_report_renderer()
    if show:
        from IPython.display import HTML, display

        print(settings.summary())
        display(HTML(plotly_loader_html()))
    return settings


def render_into(output: Any, *objects: Any) -> None:
    """Replace what an ipywidgets `Output` shows with `objects` (text is shown as printed output, other
    objects as they would display in a cell: tables, plotly figures).

    The widget's `outputs` are set directly rather than captured with `with output:`: a capture makes
    a headless executor (nbclient, under nbconvert and nbmake) send comm messages back on the kernel's
    shell channel while it waits there for the cell's reply, and that wait can then miss the reply
    and sit until the cell timeout. Setting the state sends nothing back.
    """
    from IPython.core.interactiveshell import InteractiveShell

    formatter = InteractiveShell.instance().display_formatter
    shown = []
    for obj in objects:
        if isinstance(obj, str):
            shown.append(
                {"output_type": "stream", "name": "stdout", "text": obj if obj.endswith("\n") else obj + "\n"}
            )
            continue
        if hasattr(obj, "_repr_mimebundle_"):
            # IPython formats an object with `_ipython_display_` (a plotly figure) by letting it display
            # itself, into the cell and not the widget; its mime bundle (from plotly's default renderer,
            # the report renderer after `setup_notebook`) is asked for directly instead.
            data, metadata = obj._repr_mimebundle_(), {}
        else:
            data, metadata = formatter.format(obj)
        shown.append({"output_type": "display_data", "data": data, "metadata": metadata})
    output.outputs = tuple(shown)


def show_static_then_widget(widget: Any, *objects: Any) -> None:
    """Display `objects` (a panel's current result: tables, plotly figures, text; None is skipped) as
    ordinary cell outputs, then the interactive `widget`. The static outputs keep the result readable
    where widgets are not drawn (an HTML report opened offline)."""
    from IPython.display import display

    for obj in objects:
        if obj is None:
            continue
        if isinstance(obj, str):
            print(obj)
        else:
            display(obj)
    display(widget)


class RunPanel:
    """The button-driven part of a notebook panel: a subclass sets `widget` (what the cell shows) and
    `output` (the ipywidgets `Output` its results go to) and defines `run()` (measure for the current
    settings) and `result_outputs()` (the last results as tables, figures or text; empty before the
    first run). The button's handler is `_on_click`; `show()` displays the results statically, then
    the widget."""

    widget: Any
    output: Any

    def run(self) -> Any:
        raise NotImplementedError

    def result_outputs(self) -> list[Any]:
        raise NotImplementedError

    def _on_click(self, _: Any = None) -> None:
        self.run()
        render_into(self.output, *self.result_outputs())

    def show(self) -> None:
        """Display the results so far (static: readable in an HTML report), then the widget."""
        show_static_then_widget(self.widget, *self.result_outputs())

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)
