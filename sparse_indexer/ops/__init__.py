"""One folder per op: ``__init__`` holds the checked public function, one file per backend beside it."""
