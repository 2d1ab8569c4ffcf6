"""The library API every face calls: submitting, cancelling and inspecting jobs (`jobs`), a running service's submit
socket (`intake`) and a job's environment checked at submit (`jobenv`)."""
