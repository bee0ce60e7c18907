{{/* The chart's name (app.kubernetes.io/name). */}}
{{- define "retired-pod-gc.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The objects' base name: the release's when it contains the chart's name, as deploy/base
names them when the release is called retired-pod-gc. */}}
{{- define "retired-pod-gc.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels of every object (deploy/base's app.kubernetes.io/name, plus Helm's). */}}
{{- define "retired-pod-gc.labels" -}}
app.kubernetes.io/name: {{ include "retired-pod-gc.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The controller pods' selector, as deploy/base's. */}}
{{- define "retired-pod-gc.selectorLabels" -}}
app.kubernetes.io/name: {{ include "retired-pod-gc.name" . }}
app.kubernetes.io/component: controller
{{- end -}}

{{/* repository@digest when a digest is given, else repository:tag (tag: the appVersion). */}}
{{- define "retired-pod-gc.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The Lease's name: LEASE_NAME when set, else the service's default. */}}
{{- define "retired-pod-gc.leaseName" -}}
{{- default "retired-pod-gc" .Values.config.LEASE_NAME -}}
{{- end -}}

{{/* A value of `config` as the string the service parses (numbers without an exponent). */}}
{{- define "retired-pod-gc.envValue" -}}
{{- if kindIs "float64" . -}}
{{- if eq (floor .) . -}}{{- printf "%.0f" . -}}{{- else -}}{{- printf "%v" . -}}{{- end -}}
{{- else -}}
{{- printf "%v" . -}}
{{- end -}}
{{- end -}}

{{/* The hardened security contexts, as deploy/base's (Pod Security "restricted"). */}}
{{- define "retired-pod-gc.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
# Lets the non-root user read the database Secret file (mode 0440, group 10001).
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "retired-pod-gc.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}
