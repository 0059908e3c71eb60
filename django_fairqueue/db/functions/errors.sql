-- django-fairqueue server functions: a message's error history. Every statement that fails an
-- attempt (fail_messages, rescue_expired_messages, the aborts) writes the attempt's error into
-- fairqueue_message.last_error; the trigger fairqueue_message_errors, BEFORE UPDATE OF
-- last_error, appends each new one to fairqueue_message.errors, so every path keeps its error
-- in one place without each statement knowing about the history. A statement that does not
-- name last_error in its SET list (the claim, a completion, a heartbeat) does not fire it: the
-- success path pays nothing.
--
-- The history is bounded: at most 20 entries (models.ERROR_HISTORY), the oldest dropped first,
-- each with the traceback cut to its last 2,000 characters (last_error keeps the latest whole).
-- An entry is the error as written, plus "at" (when it was written) and, when the error does
-- not say them, "attempt" and "worker" (the attempt's number and the worker that held it).

CREATE OR REPLACE FUNCTION fairqueue_message_errors_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    entry jsonb;
    history jsonb;
    tb text;
BEGIN
    IF NEW.last_error IS NULL OR NEW.last_error IS NOT DISTINCT FROM OLD.last_error THEN
        RETURN NEW;
    END IF;
    entry := jsonb_build_object('attempt', OLD.attempts, 'worker', OLD.worker_id)
             || CASE WHEN jsonb_typeof(NEW.last_error) = 'object' THEN NEW.last_error
                     ELSE jsonb_build_object('message', NEW.last_error) END
             || jsonb_build_object('at', clock_timestamp());
    tb := entry ->> 'traceback';
    IF tb IS NOT NULL AND length(tb) > 2000 THEN
        entry := entry || jsonb_build_object('traceback', '[...]' || right(tb, 2000));
    END IF;
    history := coalesce(OLD.errors, '[]'::jsonb) || jsonb_build_array(entry);
    WHILE jsonb_array_length(history) > 20 LOOP
        history := history - 0;
    END LOOP;
    NEW.errors := history;
    RETURN NEW;
END;
$$;

DROP TRIGGER IF EXISTS fairqueue_message_errors ON fairqueue_message;
CREATE TRIGGER fairqueue_message_errors
BEFORE UPDATE OF last_error ON fairqueue_message
FOR EACH ROW EXECUTE FUNCTION fairqueue_message_errors_v1();
