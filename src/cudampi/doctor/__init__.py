"""``cudampi doctor``: probe the communication stack, then report every check with a fix.

:func:`cudampi.doctor.gather.gather` runs the probes (each tool and each runtime test in a child
process), :mod:`cudampi.doctor.checks` turns the probed data into :class:`Check` rows (pure),
and :mod:`cudampi.doctor.render` prints them as a table or JSON.
"""

from cudampi.doctor.report import STATUSES, Check, Report

__all__ = ["STATUSES", "Check", "Report"]
