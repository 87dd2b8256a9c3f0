{{/* Names and labels shared by the templates. */}}
{{- define "mstar.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "mstar.operatorName" -}}
{{- printf "%s-operator" (include "mstar.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "mstar.eppRoleName" -}}
{{- printf "%s-epp" (include "mstar.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "mstar.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "mstar.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "mstar.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/part-of: mstar
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "mstar.operatorSelector" -}}
app.kubernetes.io/name: mstar-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
