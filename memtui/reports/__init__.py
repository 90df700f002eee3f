"""What memtui prints or writes from the model: the text and JSON reports, exports and
estimates."""
