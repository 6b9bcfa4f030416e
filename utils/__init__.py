"""What every layer shares and none owns: which torch device a setting names, progress of long
work, the user's cache directory and file checksums. It imports no other part of telerag."""
