"""Drop-in call shapes of other libraries, computed by rtkernels."""
