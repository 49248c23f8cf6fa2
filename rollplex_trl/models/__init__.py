"""What the package asks of each vision-language family, in one place (see `families`)."""
