"""Fairness by time: slow start orders, it never idles a worker. A claim that slow start left
short (a new channel held to one message at a time, or passed over while its first message
runs) serves the slow-starting channels with the rest, in tag order, within their caps and
rate limits, under the claim's one lease token. Installs the claim family; the claim takes two
new arguments (``p_slow_start``, ``p_token``) and its plan with groups one (``p_slow_start``),
so their old signatures are dropped first.
"""

from django.db import migrations

from django_fairqueue.migrations._sql import InstallFunctions

DROP_CHANGED = """
DROP FUNCTION IF EXISTS fairqueue_claim_v1(
    integer, interval, text, bigint[], bigint[], integer, boolean, integer, boolean, text[],
    text[]);
DROP FUNCTION IF EXISTS fairqueue_plan_grouped_v1(
    integer, bigint[], bigint[], integer, integer, boolean, timestamptz, text);
"""


class Migration(migrations.Migration):
    dependencies = [("fairqueue", "0045_lighter_claims_by_time")]

    operations = [InstallFunctions("claim", first=DROP_CHANGED)]
