"""Running a job: the runner (placeholders, launch, restarts), its scheduling and the observer it reports to."""
