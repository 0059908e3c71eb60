-- django-fairqueue server functions: periodic schedules. A schedule's firing state
-- (next_fire_at, last_slot_at, fired_spec) is computed for one spec (cron, timezone, enabled). A
-- pause, a resume or an edit of the cron or timezone is recorded on the row by the same UPDATE
-- that makes it, whatever writes it (the admin, an ORM update(), the code schedules' sync,
-- hand-written SQL): fired_spec is cleared, so the row is stale (due for a fresh next slot, no
-- catching up) until a firing pass computes it again. Comparing the spec alone would miss a
-- pause undone, or an edit reverted, before any pass ran (the fleet down for maintenance): the
-- spec would then equal fired_spec again, and the pass would fire every slot of the pause. A
-- pass that read the row before the edit finds fired_spec changed when it advances the row
-- (advance_schedule) and rolls its slots back.

CREATE OR REPLACE FUNCTION fairqueue_schedule_edited_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.fired_spec := NULL;
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS fq_schedule_edited ON fairqueue_schedule;
CREATE TRIGGER fq_schedule_edited
    BEFORE UPDATE OF cron, timezone, enabled ON fairqueue_schedule
    FOR EACH ROW
    WHEN (OLD.cron IS DISTINCT FROM NEW.cron
          OR OLD.timezone IS DISTINCT FROM NEW.timezone
          OR OLD.enabled IS DISTINCT FROM NEW.enabled)
    EXECUTE FUNCTION fairqueue_schedule_edited_v1();
