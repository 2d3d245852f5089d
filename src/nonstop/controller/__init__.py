"""The controller: turns what the job reports into generations and incidents."""
