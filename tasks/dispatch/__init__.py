"""Dispatch: plans turned into ledger entries and Celery task messages (chains),
and the reconciler that publishes again what is overdue with nobody on it
(reconcile, with the re-drivers of redrive). Imports the ledger, delivery and
tasks/'s base."""
