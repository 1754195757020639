"""Operations: what an operator does and sees — a send and its order, retry and
cancel, listings, queue depths, the janitor. May import every other subsystem;
none imports it (only the Celery tasks and workers/ do)."""
