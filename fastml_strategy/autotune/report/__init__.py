"""The outputs of an autotuning run: plan.json, report.html (self-contained, plots embedded as base64
PNG), report.md and CSV tables, every file written atomically, so a crash never leaves half a report.

The report opens with its answer in words (:func:`headline`): which plan on which option, or plain
DDP when no compression pays, with the predicted saving in time and money for the training length the
user gave (or an assumed one, said so). Times and money read in human units (ms, s, min, h, days; $);
the CSV tables keep plain numbers (seconds, hours, USD) for other tools.

With local steps searched (the default for DDP), a table, a CSV (``local_steps.csv``) and a figure
set per-step compression (the tuned plan, or plain DDP where no compression pays) against the best
:class:`~fastml_strategy.LocalSGD` configuration per option, and say which wins and by how much in
hours and dollars; the headline and the command's last line name the winner of plan.json's option.

Data apart from rendering, one layer on the next:

- ``words``: the answer and every sentence, as strings;
- ``data``: every table as a DataFrame (:func:`tables`; the CSV files hold them);
- ``plots``: the figures, from those tables;
- ``render``: report.md and report.html composed from the three, and the files written
  (:func:`write_outputs`).
"""

from fastml_strategy.autotune.report.data import bits_per_element, tables
from fastml_strategy.autotune.report.plots import figures
from fastml_strategy.autotune.report.render import LOCAL_FILES, OUTPUT_FILES, SHARDED_FILES, write_outputs
from fastml_strategy.autotune.report.words import headline, human_money, human_time, phase_words, winner_line

__all__ = ["write_outputs", "tables", "figures", "bits_per_element", "headline", "winner_line", "human_time",
           "human_money", "phase_words", "OUTPUT_FILES", "SHARDED_FILES", "LOCAL_FILES"]
